// Gloo backend: the Gloo library over TCP (one gloo::Context per group), rendezvous through a
// c10d::TCPStore hosted by rank 0 at MASTER_ADDR:MASTER_PORT. See Note [Gloo backend] in
// docs/design.md.
#pragma once

#include "comm/process_group_impl.h"
#include "comm/rendezvous.h"

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <memory>
#include <string>

namespace fsdp::detail {

struct GlooWorldOptions {
  RendezvousOptions rendezvous;  // rank, size, MASTER_ADDR:MASTER_PORT, job id
  std::chrono::milliseconds timeout{std::chrono::minutes(10)};  // per collective
};

struct GlooWorld {
  std::unique_ptr<Transport> transport;
  // A second client of the rendezvous store, for the Monitor's heartbeats.
  c10::intrusive_ptr<c10d::Store> monitor_store;
};

// Collective over all ranks: connects to (or, on rank 0, hosts) the store and connects the
// world's full mesh.
GlooWorld make_gloo_world(const GlooWorldOptions& options);

}  // namespace fsdp::detail
