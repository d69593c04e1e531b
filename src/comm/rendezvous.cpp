// Rendezvous: rank 0 hosts a c10d::TCPStore, every rank proves it belongs to the same job.
#include "comm/rendezvous.h"

#include "common/settings.h"
#include "common/text.h"

#include <c10/util/Exception.h>
#include <c10/util/Logging.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <random>
#include <sstream>
#include <thread>

namespace fsdp::detail {

// Note [Rendezvous handshake]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Rank 0 listens on MASTER_ADDR:MASTER_PORT (only there: 127.0.0.1 for a one-host job, the
// given address for a multi-host one; never every interface) and publishes "fsdp/job" =
// "<job id>\n<world size>". Every other rank connects, reads it and
//  - leaves at once if the job id differs: it reached another job's rendezvous (two jobs on one
//    port); it writes nothing, so the other job never notices it;
//  - if the world size differs, writes "<job>/refusal" (so rank 0 fails at once too) and leaves;
//  - else writes "<job>/hello/<rank>" = "<rank> <hostname> <address>" and waits for the roster
//    (Note [Naming a lost peer]), which rank 0 writes once every rank said hello.
// Rank 0 waits for every hello (listing the missing ranks when the timeout passes). All later
// keys (Gloo's pair addresses, heartbeats) live under "fsdp/job/<job id>/", so a rank of
// another job cannot overwrite them. The job id is not a secret: it stops accidents (a stray
// rank, a second job on the same port), not an attacker who can reach the port; for that,
// keep the rendezvous on loopback or a private network (see docs/errors.md "Security").
//
// Note [Naming a lost peer]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~
// When a host dies, the survivors learn it from Gloo as "Connection closed by peer
// [10.77.0.2]:41234": an address, not a rank. At the rendezvous every rank says which host and
// address it runs on (its hello); rank 0 publishes the roster of all of them ("<job>/roster",
// one "rank host address" line per rank) and every rank keeps it, so a collective that fails on
// a lost connection can say which host and ranks went away without asking anybody (the store
// may have been on the lost host).
namespace {

constexpr const char* kJobKey = "fsdp/job";

struct RosterEntry {
  int rank = 0;
  std::string host, address;
};
std::mutex g_roster_mutex;
std::vector<RosterEntry> g_roster;

std::string hello_of(const RendezvousOptions& o, const std::string& host) {
  return std::to_string(o.rank) + " " + host + " " +
         (o.local_address.empty() ? "?" : o.local_address);
}

void keep_roster(const std::string& text) {
  std::vector<RosterEntry> roster;
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) {
    RosterEntry e;
    std::istringstream fields(line);
    if (fields >> e.rank >> e.host >> e.address) roster.push_back(e);
  }
  std::lock_guard<std::mutex> lock(g_roster_mutex);
  g_roster = std::move(roster);
}

std::string endpoint(const RendezvousOptions& o) {
  return o.master_addr + ":" + std::to_string(o.master_port);
}

std::string seconds(std::chrono::milliseconds ms) {
  std::ostringstream out;
  out << static_cast<double>(ms.count()) / 1000.0 << " s";
  return out.str();
}

std::vector<uint8_t> bytes_of(const std::string& s) { return {s.begin(), s.end()}; }
std::string string_of(const std::vector<uint8_t>& v) { return {v.begin(), v.end()}; }

std::string this_host() {
  char name[256] = {};
  if (::gethostname(name, sizeof(name) - 1) != 0) return "?";
  return name;
}

// The listening socket rank 0's store takes over (TCPStoreOptions::masterListenFd), bound to
// the one address the job uses. See Note [Rendezvous handshake].
int listen_socket(const RendezvousOptions& o) {
  const std::string host = is_loopback(o.master_addr)
                               ? (o.master_addr == "::1" ? "::1" : "127.0.0.1")
                               : o.master_addr;
  TORCH_CHECK(!is_wildcard_address(o.master_addr),
              wildcard_address_error("[init_process_group]", "MASTER_ADDR", o.master_addr));
  const int fd = listen_on(host, o.master_port);
  if (fd >= 0) return fd;
  const int err = -fd;
  if (err == EADDRINUSE) {
    TORCH_CHECK(false, "[init_process_group] rank 0 cannot host the rendezvous on ",
                endpoint(o), ": the port is in use (another job, or another program, listens "
                "there); give this job its own port (fsdp-run --master-port, or MASTER_PORT)");
  }
  if (err == EADDRNOTAVAIL) {
    TORCH_CHECK(false, "[init_process_group] rank 0 cannot host the rendezvous on ",
                endpoint(o), ": ", o.master_addr, " is not an address of this host; rank 0 "
                "must run on the MASTER_ADDR host (fsdp-run --node-rank 0 there)");
  }
  TORCH_CHECK(false, "[init_process_group] rank 0 cannot listen on ", endpoint(o), ": ",
              std::strerror(err));
}

c10::intrusive_ptr<c10d::TCPStore> connect_store(const RendezvousOptions& o, int listen_fd,
                                                 std::chrono::milliseconds timeout) {
  c10d::TCPStoreOptions so;
  so.port = static_cast<std::uint16_t>(o.master_port);
  so.isServer = listen_fd >= 0;
  so.waitWorkers = false;  // the handshake below counts only this job's ranks
  so.timeout = timeout;
  if (listen_fd >= 0) so.masterListenFd = listen_fd;
  return c10::make_intrusive<c10d::TCPStore>(o.master_addr, so);
}

void host_handshake(c10d::Store& store, const RendezvousOptions& o, const std::string& prefix) {
  store.set(kJobKey, bytes_of(o.job_id + "\n" + std::to_string(o.size)));
  const auto deadline = std::chrono::steady_clock::now() + o.timeout;
  std::vector<int> missing;
  for (int r = 1; r < o.size; ++r) missing.push_back(r);
  while (!missing.empty()) {
    if (store.check({prefix + "refusal"})) {
      TORCH_CHECK(false, "[init_process_group] rank 0: ",
                  string_of(store.get(prefix + "refusal")));
    }
    std::vector<int> still;
    for (int r : missing) {
      if (!store.check({prefix + "hello/" + std::to_string(r)})) still.push_back(r);
    }
    missing = std::move(still);
    if (missing.empty()) break;
    if (std::chrono::steady_clock::now() > deadline) {
      std::ostringstream list;
      for (size_t i = 0; i < missing.size() && i < 16; ++i) list << (i ? "," : "") << missing[i];
      if (missing.size() > 16) list << ",...";
      TORCH_CHECK(false, "[init_process_group] rank 0: ", missing.size(), " of ", o.size - 1,
                  " ranks did not join the rendezvous at ", endpoint(o), " within ",
                  seconds(o.timeout), " (missing ranks ", list.str(),
                  "); start them with the same MASTER_ADDR, MASTER_PORT, WORLD_SIZE and job id "
                  "(FSDP_RENDEZVOUS_TIMEOUT_S sets the wait)");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  std::string roster = hello_of(o, this_host()) + "\n";
  for (int r = 1; r < o.size; ++r) {
    roster += string_of(store.get(prefix + "hello/" + std::to_string(r))) + "\n";
  }
  store.set(prefix + "roster", bytes_of(roster));
  keep_roster(roster);
}

void join_handshake(c10d::Store& store, const RendezvousOptions& o, const std::string& prefix) {
  try {
    store.wait({kJobKey}, o.timeout);
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "[init_process_group] rank ", o.rank, " reached ", endpoint(o),
                " but no fsdp job is hosted there (", first_line(e.what()),
                "); is MASTER_PORT another program's port?");
  }
  const std::string value = string_of(store.get(kJobKey));
  const auto nl = value.find('\n');
  const std::string their_job = value.substr(0, nl);
  const int their_size = nl == std::string::npos ? -1 : std::atoi(value.c_str() + nl + 1);
  TORCH_CHECK(their_job == o.job_id, "[init_process_group] rank ", o.rank, ": the rendezvous at ",
              endpoint(o), " belongs to another job (job id '", their_job, "', this rank's is '",
              o.job_id, "'); two jobs on one port? Give each job its own port (fsdp-run "
              "--master-port, or MASTER_PORT) and one job id on all its nodes (fsdp-run "
              "--job-id, or FSDP_JOB_ID)");
  if (their_size != o.size) {
    std::ostringstream why;
    why << "rank " << o.rank << " (host " << this_host() << ") was started with world size "
        << o.size << ", rank 0 at " << endpoint(o) << " with world size " << their_size
        << "; start every rank with the same WORLD_SIZE (fsdp-run: the same -n and --nnodes "
           "on every node)";
    try {
      store.set(prefix + "refusal", bytes_of(why.str()));
    } catch (const std::exception&) {
      // rank 0 then reports the rank as missing
    }
    TORCH_CHECK(false, "[init_process_group] ", why.str());
  }
  store.set(prefix + "hello/" + std::to_string(o.rank), bytes_of(hello_of(o, this_host())));
  try {
    store.wait({prefix + "roster"}, o.timeout);
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "[init_process_group] rank ", o.rank, " joined the rendezvous at ",
                endpoint(o), " but rank 0 did not admit the job within ", seconds(o.timeout),
                " (", first_line(e.what()), "); are all ", o.size, " ranks started?");
  }
  keep_roster(string_of(store.get(prefix + "roster")));
}

}  // namespace

Rendezvous rendezvous(const RendezvousOptions& o) {
  quiet_c10_logging();
  TORCH_CHECK(o.master_port > 0 && o.master_port < 65536, "[init_process_group] world size ",
              o.size, " needs MASTER_PORT (got ", o.master_port,
              "); start the ranks with fsdp-run, or set MASTER_ADDR and MASTER_PORT");
  const int listen_fd = o.rank == 0 ? listen_socket(o) : -1;
  c10::intrusive_ptr<c10d::TCPStore> tcp;
  try {
    tcp = connect_store(o, listen_fd, o.timeout);
  } catch (const std::exception& e) {
    if (o.rank == 0) {
      TORCH_CHECK(false, "[init_process_group] rank 0 could not start the rendezvous on ",
                  endpoint(o), ": ", first_line(e.what()));
    }
    TORCH_CHECK(false, "[init_process_group] rank ", o.rank, " could not reach the rendezvous at ",
                endpoint(o), " (rank 0's host) within ", seconds(o.timeout), ": ",
                first_line(e.what()),
                "; is rank 0 running, MASTER_ADDR/MASTER_PORT the same on every node, and the "
                "port reachable from this host?");
  }
  const std::string prefix = "fsdp/job/" + o.job_id + "/";
  if (o.rank == 0) {
    host_handshake(*tcp, o, prefix);
  } else {
    join_handshake(*tcp, o, prefix);
  }
  Rendezvous out;
  out.store = c10::make_intrusive<c10d::PrefixStore>(prefix + "keys", tcp);
  c10d::TCPStoreOptions mo;
  mo.port = static_cast<std::uint16_t>(o.master_port);
  mo.isServer = false;
  mo.waitWorkers = false;
  mo.timeout = std::chrono::seconds(10);
  out.monitor_store = c10::make_intrusive<c10d::PrefixStore>(
      prefix + "keys", c10::make_intrusive<c10d::TCPStore>(o.master_addr, mo));
  return out;
}

bool is_loopback(const std::string& host) {
  return host == "localhost" || host.rfind("127.", 0) == 0 || host == "::1";
}

bool is_wildcard_address(const std::string& host) {
  std::string h = host;
  if (h.size() >= 2 && h.front() == '[' && h.back() == ']') h = h.substr(1, h.size() - 2);
  if (h.empty()) return true;
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  if (getaddrinfo(h.c_str(), nullptr, &hints, &res) != 0) return false;
  bool wildcard = false;
  for (addrinfo* ai = res; ai; ai = ai->ai_next) {
    if (ai->ai_family == AF_INET) {
      wildcard |= reinterpret_cast<sockaddr_in*>(ai->ai_addr)->sin_addr.s_addr == htonl(INADDR_ANY);
    } else if (ai->ai_family == AF_INET6) {
      wildcard |= IN6_IS_ADDR_UNSPECIFIED(&reinterpret_cast<sockaddr_in6*>(ai->ai_addr)->sin6_addr);
    }
  }
  freeaddrinfo(res);
  return wildcard;
}

std::string wildcard_address_error(const std::string& who, const std::string& what,
                                   const std::string& host) {
  return who + " " + what + " '" + host + "' is the wildcard address (every interface of the " +
         "host), and the rendezvous listens on one address only; give rank 0's host's concrete " +
         "address: 127.0.0.1 when every rank runs on this host, else the address of the " +
         "interface the other nodes reach (e.g. 10.0.0.1)";
}

void quiet_c10_logging() {
  // c10d logs each failure (with a C++ backtrace) before throwing it, and warns whenever it
  // cannot reverse-resolve a client; we report the exception once, in one sentence. So c10's
  // log level goes to FATAL unless the user chose one (TORCH_CPP_LOG_LEVEL).
  if (!read_settings().torch_log_level_set) {
    FLAGS_caffe2_log_level = std::max(FLAGS_caffe2_log_level, 3);
  }
}

int listen_on(const std::string& host, int port) {
  if (is_wildcard_address(host)) return -EINVAL;  // never every interface
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  if (getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &res) != 0) {
    return -EADDRNOTAVAIL;
  }
  int fd = -1, err = EADDRNOTAVAIL;
  for (addrinfo* ai = res; ai; ai = ai->ai_next) {
    fd = ::socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC, 0);
    if (fd < 0) {
      err = errno;
      continue;
    }
    int one = 1;
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (::bind(fd, ai->ai_addr, ai->ai_addrlen) == 0 && ::listen(fd, 1024) == 0) break;
    err = errno;
    ::close(fd);
    fd = -1;
  }
  freeaddrinfo(res);
  return fd >= 0 ? fd : -err;
}

std::string describe_peer_in(const std::string& error_text) {
  std::lock_guard<std::mutex> lock(g_roster_mutex);
  for (const auto& e : g_roster) {
    if (e.address == "?" || is_loopback(e.address)) continue;
    if (error_text.find("[" + e.address + "]") == std::string::npos) continue;
    std::string ranks;
    for (const auto& other : g_roster) {
      if (other.address == e.address) ranks += (ranks.empty() ? "" : ",") + std::to_string(other.rank);
    }
    return "the peer " + e.address + " is host " + e.host + " (ranks " + ranks + ")";
  }
  return "";
}

std::string hosts_of_ranks(const std::vector<int>& ranks) {
  std::lock_guard<std::mutex> lock(g_roster_mutex);
  std::vector<std::string> seen;
  for (const auto& e : g_roster) {
    if (std::find(ranks.begin(), ranks.end(), e.rank) == ranks.end()) continue;
    if (e.address == "?" || is_loopback(e.address)) continue;
    const std::string h = "host " + e.host + " at " + e.address;
    if (std::find(seen.begin(), seen.end(), h) == seen.end()) seen.push_back(h);
  }
  std::string out;
  for (const auto& h : seen) out += (out.empty() ? "" : ", ") + h;
  return out;
}

std::string random_job_id() {
  std::random_device rd;
  std::ostringstream out;
  out << std::hex << ((static_cast<uint64_t>(rd()) << 32) ^ rd());
  return out.str();
}

}  // namespace fsdp::detail
