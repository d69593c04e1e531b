// Rendezvous: the job's key-value store (a c10d::TCPStore hosted by rank 0 at
// MASTER_ADDR:MASTER_PORT) and the handshake that admits only this job's ranks.
// See Note [Rendezvous handshake] in rendezvous.cpp and docs/errors.md for the messages.
#pragma once

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <string>

namespace fsdp::detail {

struct RendezvousOptions {
  int rank = 0;
  int size = 1;
  std::string master_addr = "127.0.0.1";
  int master_port = 0;
  // How long rank 0 waits for the others to join and the others wait to reach rank 0.
  std::chrono::milliseconds timeout{std::chrono::minutes(1)};
  std::string job_id;  // "" = unnamed; ranks of one job must agree (Settings::job_id)
  std::string local_address;  // this rank's address as the other ranks see it (for the roster)
};

struct Rendezvous {
  // This job's keys only (a PrefixStore over the TCPStore): groups rendezvous through it.
  c10::intrusive_ptr<c10d::Store> store;
  // A second connection under the same prefix, for the Monitor's heartbeats.
  c10::intrusive_ptr<c10d::Store> monitor_store;
};

// Hosts (rank 0) or reaches the store, then runs the handshake. Every failure is one
// TORCH_CHECK message naming the address, the rank(s) and the remedy.
Rendezvous rendezvous(const RendezvousOptions& options);

// c10's log level to FATAL unless TORCH_CPP_LOG_LEVEL is set: c10d logs every store failure with
// a C++ backtrace before it throws; the exception is reported once, in one line. Idempotent.
void quiet_c10_logging();

// A TCP socket bound to host:port (port 0: any free one) and listening, SO_REUSEADDR, close on
// exec; or -errno (-EADDRNOTAVAIL also when `host` does not resolve, -EINVAL when it is a
// wildcard address: see is_wildcard_address). Stores take it over through
// TCPStoreOptions::masterListenFd, so they listen only there (see Note [Rendezvous handshake]).
int listen_on(const std::string& host, int port);

// True when `host` is this host by its loopback name or address ("localhost", 127.x, "::1").
bool is_loopback(const std::string& host);

// True when `host` is a wildcard address ("0", "0.0.0.0", "::", "[::]", "", or a name that
// resolves to one): listening there means every interface, which the rendezvous never does
// (see Note [Rendezvous handshake]).
bool is_wildcard_address(const std::string& host);
// The one-sentence error for a wildcard address given as `what` ("--master-addr",
// "MASTER_ADDR"), prefixed by `who` ("[fsdp-run]").
std::string wildcard_address_error(const std::string& who, const std::string& what,
                                   const std::string& host);

// See Note [Naming a lost peer]: for the first non-loopback rank address of this job's roster
// that appears in `error_text` (Gloo names the peer "[10.77.0.2]:41234"), "the peer 10.77.0.2
// is host h1 (ranks 2,3)"; else "".
std::string describe_peer_in(const std::string& error_text);
// The hosts of these world ranks from the roster, "host h1 at 10.77.0.2" (several joined by
// ", "); "" when the roster is empty or the ranks are on loopback (one host).
std::string hosts_of_ranks(const std::vector<int>& ranks);

// A fresh random job id (16 hex digits) for launchers that start every rank themselves.
std::string random_job_id();

}  // namespace fsdp::detail
