// init_process_group, world_group, destroy_process_group, make_2d_mesh.
#include "comm/debug.h"
#include "comm/gloo_transport.h"
#include "comm/mpi_transport.h"
#include "comm/process_group_impl.h"
#include "comm/rendezvous.h"
#include "common/device_choice.h"
#include "common/settings.h"
#include "cuda/cuda_api.h"

#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include <cstdlib>
#include <mutex>
#include <sstream>

namespace fsdp {

namespace {

enum class BackendKind { kGloo, kMpi, kNccl };

struct Globals {
  std::mutex mutex;
  std::shared_ptr<detail::GroupImpl> world;
  ProcessGroupPtr nccl_world;  // backend "nccl" (src/cuda/nccl_process_group.h): not a GroupImpl
  std::vector<std::weak_ptr<detail::GroupImpl>> groups;
  bool atexit_registered = false;
};

Globals& globals() {
  static auto* g = new Globals();  // leaked on purpose: used from atexit
  return *g;
}

BackendKind parse_backend(const std::string& name, const detail::Settings& settings) {
  if (name == "gloo") return BackendKind::kGloo;
  if (name == "mpi") return BackendKind::kMpi;
  if (name == "nccl") return BackendKind::kNccl;
  if (name == "auto" || name.empty()) {
    return settings.mpirun_world_size && detail::mpi_built() ? BackendKind::kMpi
                                                             : BackendKind::kGloo;
  }
  TORCH_CHECK(false, "[init_process_group] unknown backend '", name,
              "'; valid backends: gloo, mpi, nccl (CUDA builds), auto (mpi when launched by mpirun, "
              "else gloo)");
}

std::chrono::milliseconds timeout_from(const ProcessGroupOptions& options,
                                       const detail::Settings& settings) {
  if (!settings.collective_timeout_s) return options.timeout;
  return std::chrono::milliseconds(static_cast<int64_t>(*settings.collective_timeout_s * 1000.0));
}

void shutdown_all_locked(Globals& g) {
  // Newest first: subgroups before the world group they were split from.
  for (auto it = g.groups.rbegin(); it != g.groups.rend(); ++it) {
    if (auto group = it->lock()) group->shutdown();
  }
  g.groups.clear();
  g.world.reset();
  g.nccl_world.reset();  // destroys the communicator once no Work or subgroup holds it
}

void at_exit() {
  auto& g = globals();
  {
    std::lock_guard<std::mutex> lock(g.mutex);
    shutdown_all_locked(g);
  }
  detail::finalize_mpi();
}

}  // namespace

namespace detail {
void track_group(const std::shared_ptr<GroupImpl>& group) {
  auto& g = globals();
  std::lock_guard<std::mutex> lock(g.mutex);
  g.groups.erase(std::remove_if(g.groups.begin(), g.groups.end(),
                                [](const std::weak_ptr<GroupImpl>& w) { return w.expired(); }),
                 g.groups.end());
  g.groups.push_back(group);
}
}  // namespace detail

namespace {
// Backend "nccl": this rank's device (src/common/device_choice.h: one rank per device), the
// rendezvous store for the ncclUniqueId, one communicator. NCCL queues on CUDA streams (Note
// [NCCL streams]), not on a comm thread; the Monitor's heartbeats name the missing ranks when
// its watchdog times a collective out (Note [NCCL watchdog]).
ProcessGroupPtr init_nccl_world(const ProcessGroupOptions& options,
                                const detail::Settings& settings, int rank, int size,
                                std::chrono::milliseconds timeout) {
  const detail::DeviceFacts facts{detail::cuda_built(), detail::cuda_device_count()};
  if (!facts.cuda_built) return detail::make_nccl_group({});  // the "no CUDA in this build" error
  const LaunchInfo& launch = settings.launch;
  const detail::DeviceChoice device = detail::choose_device(
      "cuda", launch.local_rank, std::max(launch.local_world_size, 1), "nccl", facts);
  detail::NcclGroupOptions no;
  no.rank = rank;
  no.size = size;
  no.device = device.index;
  no.timeout = std::max<std::chrono::milliseconds>(timeout, std::chrono::minutes(1));
  no.collective_timeout = timeout;
  if (size > 1) {
    detail::RendezvousOptions ro;
    ro.rank = rank;
    ro.size = size;
    ro.master_addr = !options.master_addr.empty() ? options.master_addr : launch.master_addr;
    ro.master_port = options.master_port > 0 ? options.master_port : launch.master_port;
    ro.job_id = settings.job_id;
    ro.timeout = no.timeout;
    detail::Rendezvous rv = detail::rendezvous(ro);
    no.store = rv.store;
    no.monitor_store = rv.monitor_store;
  } else {
    no.store = c10::make_intrusive<c10d::HashStore>();
  }
  return detail::make_nccl_group(no);
}
}  // namespace

ProcessGroupPtr init_process_group(const ProcessGroupOptions& options) {
  const detail::Settings settings = detail::read_settings();
  const BackendKind kind = parse_backend(options.backend, settings);
  const auto timeout = timeout_from(options, settings);
  {
    auto& g = globals();
    std::lock_guard<std::mutex> lock(g.mutex);
    shutdown_all_locked(g);  // re-initialisation replaces the previous world
    if (!g.atexit_registered) {
      std::atexit(at_exit);
      g.atexit_registered = true;
    }
  }
  // The launcher's ranks (torchrun-style, mpirun, SLURM, fsdp::launch), unless given.
  const LaunchInfo& launch = settings.launch;
  int rank = options.rank >= 0 ? options.rank : launch.rank;
  int size = options.world_size > 0 ? options.world_size : launch.world_size;
  TORCH_CHECK(size >= 1 && rank >= 0 && rank < size, "[init_process_group] rank ", rank,
              " is not in [0, world size ", size, "); check RANK and WORLD_SIZE");

  if (kind == BackendKind::kNccl) {
    auto group = init_nccl_world(options, settings, rank, size, timeout);
    auto& g = globals();
    std::lock_guard<std::mutex> lock(g.mutex);
    g.nccl_world = group;
    return group;
  }

  detail::GroupConfig cfg;
  cfg.backend = kind == BackendKind::kGloo ? "gloo" : "mpi";
  cfg.name = "world";
  cfg.uid = "world";
  cfg.timeout = timeout;
  cfg.debug_detail = settings.debug == detail::DebugLevel::kDetail;

  std::unique_ptr<detail::Transport> transport;
  std::shared_ptr<detail::CommThread> thread;
  c10::intrusive_ptr<c10d::Store> monitor_store;
  bool own_thread = true;
  if (kind == BackendKind::kMpi) {
    TORCH_CHECK(detail::mpi_built(),
                "[init_process_group] backend 'mpi' is not built in; reconfigure with "
                "-DFSDP_WITH_MPI=ON or use backend 'gloo'");
    const bool under_mpirun = settings.mpirun_world_size.has_value();
    TORCH_CHECK(under_mpirun || size == 1, "[init_process_group] backend 'mpi' at world size ",
                size,
                " needs ranks started by mpirun (OMPI_COMM_WORLD_SIZE is not set); run "
                "`fsdp-run -n N --backend mpi -- PROGRAM` or `mpirun -n N PROGRAM`, or use "
                "backend 'gloo'");
    if (under_mpirun && *settings.mpirun_world_size > 1) {
      auto world = detail::make_mpi_world();
      TORCH_CHECK(options.world_size <= 0 || options.world_size == world.size,
                  "[init_process_group] world_size ", options.world_size,
                  " disagrees with mpirun's ", world.size);
      rank = world.rank;
      size = world.size;
      transport = std::move(world.transport);
      thread = world.thread;
      monitor_store = world.monitor_store;
      own_thread = false;
    }
  } else if (size > 1) {
    detail::GlooWorldOptions go;
    go.rendezvous.rank = rank;
    go.rendezvous.size = size;
    go.rendezvous.master_addr =
        !options.master_addr.empty() ? options.master_addr : launch.master_addr;
    go.rendezvous.master_port = options.master_port > 0 ? options.master_port : launch.master_port;
    go.rendezvous.job_id = settings.job_id;
    // Rendezvous can wait for slow-starting ranks longer than one collective may take.
    go.rendezvous.timeout =
        settings.rendezvous_timeout_s
            ? std::chrono::milliseconds(static_cast<int64_t>(*settings.rendezvous_timeout_s * 1000.0))
            : std::max<std::chrono::milliseconds>(timeout, std::chrono::minutes(1));
    go.timeout = timeout;
    auto world = detail::make_gloo_world(go);
    transport = std::move(world.transport);
    monitor_store = world.monitor_store;
    thread = std::make_shared<detail::CommThread>("fsdp-comm world");
  }
  if (size == 1) {
    transport.reset();
    thread.reset();
  }
  cfg.rank = rank;
  cfg.size = size;
  for (int r = 0; r < size; ++r) cfg.world_ranks.push_back(r);
  std::shared_ptr<detail::Monitor> monitor;
  if (size > 1 && monitor_store) {
    auto period = std::clamp<std::chrono::milliseconds>(
        timeout / 4, std::chrono::milliseconds(100), std::chrono::milliseconds(1000));
    monitor = std::make_shared<detail::Monitor>(monitor_store, rank, period);
  }
  auto group = std::make_shared<detail::GroupImpl>(std::move(cfg), std::move(transport),
                                                   std::move(thread), std::move(monitor),
                                                   own_thread);
  detail::track_group(group);
  auto& g = globals();
  std::lock_guard<std::mutex> lock(g.mutex);
  g.world = group;
  return group;
}

at::Tensor all_gather_host(ProcessGroup& group, const at::Tensor& host) {
  at::Tensor mine = host.to(group.device()).contiguous().view({-1});
  at::Tensor all = at::empty({group.size() * mine.numel()}, mine.options());
  group.all_gather_into_tensor(all, mine);
  return all.cpu();
}

std::vector<int64_t> all_gather_values(ProcessGroup& group, const std::vector<int64_t>& values) {
  const at::Tensor all = all_gather_host(group, at::tensor(values, at::kLong));
  const int64_t* data = all.const_data_ptr<int64_t>();
  return std::vector<int64_t>(data, data + all.numel());
}

void broadcast_host(ProcessGroup& group, at::Tensor& host, int root) {
  at::Tensor sent = host.to(group.device());
  group.broadcast(sent, root);
  if (!sent.is_same(host)) host.copy_(sent);
}

ProcessGroupPtr world_group() {
  auto& g = globals();
  std::lock_guard<std::mutex> lock(g.mutex);
  if (g.world) return g.world;
  return g.nccl_world;
}

void destroy_process_group() {
  auto& g = globals();
  std::lock_guard<std::mutex> lock(g.mutex);
  shutdown_all_locked(g);
}

DeviceMesh make_2d_mesh(const ProcessGroupPtr& world, int shard_size) {
  TORCH_CHECK(world != nullptr, "[make_2d_mesh] world group is null; call init_process_group first");
  const int n = world->size();
  if (shard_size <= 0 || n % shard_size != 0) {
    std::ostringstream divisors;
    for (int d = 1; d <= n; ++d) {
      if (n % d == 0) divisors << (d > 1 ? ", " : "") << d;
    }
    TORCH_CHECK(false, "[make_2d_mesh] world size ", n, " is not divisible by shard_size ",
                shard_size, "; choose one of: ", divisors.str());
  }
  const auto& ranks = world->world_ranks();
  DeviceMesh mesh;
  mesh.shard_size = shard_size;
  mesh.replicate_size = n / shard_size;
  auto name = [](const char* kind, const std::vector<int>& rs) {
    std::ostringstream out;
    out << kind << "[";
    for (size_t i = 0; i < rs.size(); ++i) out << (i ? "," : "") << rs[i];
    out << "]";
    return out.str();
  };
  // Every rank creates every subgroup in the same order (new_subgroup is collective).
  for (int g = 0; g < mesh.replicate_size; ++g) {
    std::vector<int> members(ranks.begin() + g * shard_size,
                             ranks.begin() + (g + 1) * shard_size);
    if (auto sub = world->new_subgroup(members)) {
      if (auto* impl = dynamic_cast<detail::GroupImpl*>(sub.get())) {
        impl->set_name(name("shard", members));
      }
      mesh.shard_group = sub;
    }
  }
  for (int i = 0; i < shard_size; ++i) {
    std::vector<int> members;
    for (int g = 0; g < mesh.replicate_size; ++g) members.push_back(ranks[g * shard_size + i]);
    if (auto sub = world->new_subgroup(members)) {
      if (auto* impl = dynamic_cast<detail::GroupImpl*>(sub.get())) {
        impl->set_name(name("replicate", members));
      }
      mesh.replicate_group = sub;
    }
  }
  TORCH_INTERNAL_ASSERT(mesh.shard_group && mesh.replicate_group);
  return mesh;
}

}  // namespace fsdp
