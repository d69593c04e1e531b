#include "comm/mpi_transport.h"

#include "comm/rendezvous.h"
#include "common/settings.h"

#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <unistd.h>

#ifdef FSDP_WITH_MPI
// Only MPI's C API: CMake links MPI::MPI_C, not OpenMPI's deprecated C++ bindings.
#define OMPI_SKIP_MPICXX 1
#define MPICH_SKIP_MPICXX 1
#include <mpi.h>
#endif

namespace fsdp::detail {

// Note [MPI progress and yielding]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// OpenMPI (4.1, ob1/vader on one host) progresses a non-blocking collective only while some MPI
// call runs in that process, so MPI_Iallgather + compute + MPI_Wait moves most bytes in
// MPI_Wait. We therefore make blocking MPI calls on a dedicated comm thread (Note [Comm
// thread]); MPI is initialised on that thread with MPI_THREAD_FUNNELED, and every MPI call of
// the process (including MPI_Finalize) goes through it.
// A rank blocked in an MPI collective polls: with more ranks than cores (ctest, 4 ranks on 2
// cores) that spinning steals the core the late rank needs. mpirun sets yield_when_idle when it
// knows it oversubscribes; we also default OMPI_MCA_mpi_yield_when_idle=1 (unless the user set
// it) before MPI_Init, so waiting ranks sched_yield() between polls. Measured cost on one host:
// within noise for 64 MiB messages.

bool mpi_built() {
#ifdef FSDP_WITH_MPI
  return true;
#else
  return false;
#endif
}

#ifdef FSDP_WITH_MPI

namespace {

// Where rank 0's heartbeat store listens when ranks run on other hosts: MASTER_ADDR when it is
// set and not loopback, else the first up, non-loopback IPv4 address of this host.
std::string store_address_for_other_hosts() {
  const std::string master = read_settings().launch.master_addr;  // 127.0.0.1 when unset
  TORCH_CHECK(!is_wildcard_address(master), wildcard_address_error("[mpi]", "MASTER_ADDR", master));
  if (master.rfind("127.", 0) != 0 && master != "localhost") return master;
  ifaddrs* list = nullptr;
  std::string out;
  if (getifaddrs(&list) == 0) {
    for (ifaddrs* a = list; a && out.empty(); a = a->ifa_next) {
      if (!a->ifa_addr || a->ifa_addr->sa_family != AF_INET) continue;
      if ((a->ifa_flags & IFF_UP) == 0 || (a->ifa_flags & IFF_LOOPBACK) != 0) continue;
      char text[INET_ADDRSTRLEN] = {};
      if (inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(a->ifa_addr)->sin_addr, text,
                    sizeof(text))) {
        out = text;
      }
    }
    freeifaddrs(list);
  }
  TORCH_CHECK(!out.empty(), "[mpi] rank 0's host has no non-loopback IPv4 address for the "
              "heartbeat store; set MASTER_ADDR to an address the other hosts reach");
  return out;
}


std::shared_ptr<CommThread>& mpi_thread() {
  // Leaked on purpose: finalize_mpi runs from atexit, after function-local statics created
  // later than the atexit registration would already be destroyed.
  static auto* thread = new std::shared_ptr<CommThread>();
  return *thread;
}
bool g_mpi_finalized = false;

void check_mpi(int rc, const char* call) {
  if (rc == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(rc, text, &len);
  TORCH_CHECK(false, "[mpi] ", call, " failed: ", std::string(text, len));
}

int int_count(int64_t n, const char* what) {
  TORCH_CHECK(n <= INT_MAX, "[mpi] ", what, " of ", n,
              " elements/bytes per rank exceeds MPI's int count (2^31-1); split the tensor "
              "into smaller collectives");
  return static_cast<int>(n);
}

MPI_Datatype mpi_type(at::ScalarType t) {
  switch (t) {
    case at::kFloat:
      return MPI_FLOAT;
    case at::kDouble:
      return MPI_DOUBLE;
    case at::kInt:
      return MPI_INT32_T;
    case at::kLong:
      return MPI_INT64_T;
    default:
      TORCH_INTERNAL_ASSERT(false, "no native MPI reduction for ", t);
  }
}

bool overlaps(const at::Tensor& a, const at::Tensor& b) {
  auto a0 = static_cast<const char*>(a.data_ptr());
  auto b0 = static_cast<const char*>(b.data_ptr());
  return a0 < b0 + b.nbytes() && b0 < a0 + a.nbytes();
}

class MpiTransport final : public Transport {
 public:
  explicit MpiTransport(MPI_Comm comm) : comm_(comm) {
    check_mpi(MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN), "MPI_Comm_set_errhandler");
    check_mpi(MPI_Comm_rank(comm_, &rank_), "MPI_Comm_rank");
    check_mpi(MPI_Comm_size(comm_, &size_), "MPI_Comm_size");
  }
  ~MpiTransport() override {
    if (comm_ != MPI_COMM_NULL && !g_mpi_finalized) MPI_Comm_free(&comm_);
  }

  void all_gather(const at::Tensor& output, const at::Tensor& input) override {
    const int bytes = int_count(input.nbytes(), "all_gather");
    auto* out = static_cast<char*>(output.data_ptr());
    const void* in = input.data_ptr();
    at::Tensor copy;
    if (in == out + static_cast<int64_t>(rank_) * bytes) {
      in = MPI_IN_PLACE;  // the input is this rank's chunk of the output (FSDP's copy-in)
    } else if (overlaps(input, output)) {
      copy = input.clone();
      in = copy.data_ptr();
    }
    check_mpi(MPI_Allgather(in, bytes, MPI_BYTE, out, bytes, MPI_BYTE, comm_), "MPI_Allgather");
  }

  void all_to_all(const at::Tensor& output, const at::Tensor& input) override {
    const int bytes = int_count(input.nbytes() / size_, "all_to_all");
    check_mpi(MPI_Alltoall(input.data_ptr(), bytes, MPI_BYTE, output.data_ptr(), bytes,
                           MPI_BYTE, comm_),
              "MPI_Alltoall");
  }

  void broadcast(const at::Tensor& tensor, int root) override {
    check_mpi(MPI_Bcast(tensor.data_ptr(), int_count(tensor.nbytes(), "broadcast"), MPI_BYTE,
                        root, comm_),
              "MPI_Bcast");
  }

  void barrier() override { check_mpi(MPI_Barrier(comm_), "MPI_Barrier"); }

  bool has_native_all_reduce(at::ScalarType dtype) const override { return native(dtype); }

  void all_reduce(const at::Tensor& tensor, ReduceOp op) override {
    check_mpi(MPI_Allreduce(MPI_IN_PLACE, tensor.data_ptr(),
                            int_count(tensor.numel(), "all_reduce"),
                            mpi_type(tensor.scalar_type()), mpi_op(op), comm_),
              "MPI_Allreduce");
  }

  std::unique_ptr<Transport> split(const std::vector<int>& group_ranks,
                                   const std::string&) override {
    bool member = std::find(group_ranks.begin(), group_ranks.end(), rank_) != group_ranks.end();
    MPI_Comm sub = MPI_COMM_NULL;
    check_mpi(MPI_Comm_split(comm_, member ? 0 : MPI_UNDEFINED, rank_, &sub), "MPI_Comm_split");
    if (!member) return nullptr;
    return std::make_unique<MpiTransport>(sub);
  }

 private:
  static bool native(at::ScalarType t) {
    return t == at::kFloat || t == at::kDouble || t == at::kInt || t == at::kLong;
  }
  static MPI_Op mpi_op(ReduceOp op) {
    TORCH_INTERNAL_ASSERT(op == ReduceOp::kSum || op == ReduceOp::kMax);
    return op == ReduceOp::kMax ? MPI_MAX : MPI_SUM;
  }
  MPI_Comm comm_;
  int rank_ = 0;
  int size_ = 1;
};

}  // namespace

MpiWorld make_mpi_world() {
  auto& thread = mpi_thread();
  TORCH_CHECK(!g_mpi_finalized,
              "[init_process_group] MPI was already finalized in this process and cannot be "
              "initialised again; create the mpi process group once per process");
  if (!thread) {
    thread = std::make_shared<CommThread>("fsdp-mpi");
    thread->run_sync([] {
      int initialized = 0;
      MPI_Initialized(&initialized);
      if (initialized) return;
      // See Note [MPI progress and yielding].
      setenv("OMPI_MCA_mpi_yield_when_idle", "1", /*overwrite=*/0);
      int provided = 0;
      check_mpi(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_FUNNELED, &provided),
                "MPI_Init_thread");
      TORCH_CHECK(provided >= MPI_THREAD_FUNNELED,
                  "[mpi] MPI_Init_thread gave thread level ", provided,
                  " < MPI_THREAD_FUNNELED; this OpenMPI cannot be used from a comm thread");
    });
  }
  MpiWorld world;
  world.thread = thread;
  std::string host;
  int port = 0;
  thread->run_sync([&] {
    MPI_Comm comm = MPI_COMM_NULL;
    check_mpi(MPI_Comm_dup(MPI_COMM_WORLD, &comm), "MPI_Comm_dup");
    auto t = std::make_unique<MpiTransport>(comm);
    check_mpi(MPI_Comm_rank(comm, &world.rank), "MPI_Comm_rank");
    check_mpi(MPI_Comm_size(comm, &world.size), "MPI_Comm_size");
    world.transport = std::move(t);
    if (world.size == 1) return;
    quiet_c10_logging();  // the heartbeat store's failures are reported once, by us
    // Heartbeat store: rank 0 hosts it on a free port. See Note [Collective timeouts]. It
    // listens on loopback when every rank shares rank 0's host, else on rank 0's address
    // towards the others (MASTER_ADDR when set, else its first non-loopback IPv4 address).
    char rank0_host[256] = {0};
    char my_host[256] = {0};
    gethostname(my_host, sizeof(my_host) - 1);
    if (world.rank == 0) std::memcpy(rank0_host, my_host, sizeof(rank0_host));
    check_mpi(MPI_Bcast(rank0_host, sizeof(rank0_host), MPI_CHAR, 0, comm), "MPI_Bcast");
    int remote = std::strcmp(rank0_host, my_host) != 0 ? 1 : 0, any_remote = 0;
    check_mpi(MPI_Allreduce(&remote, &any_remote, 1, MPI_INT, MPI_MAX, comm), "MPI_Allreduce");
    char rank0_addr[256] = {0};
    if (world.rank == 0) {
      const std::string addr = any_remote ? store_address_for_other_hosts() : "127.0.0.1";
      const int fd = listen_on(addr, 0);
      TORCH_CHECK(fd >= 0, "[mpi] rank 0 cannot listen on ", addr,
                  " for the heartbeat store: ", std::strerror(-fd),
                  "; set MASTER_ADDR to an address of rank 0's host that the other hosts reach");
      sockaddr_storage local{};
      socklen_t len = sizeof(local);
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&local), &len);
      port = ntohs(local.ss_family == AF_INET6
                       ? reinterpret_cast<sockaddr_in6*>(&local)->sin6_port
                       : reinterpret_cast<sockaddr_in*>(&local)->sin_port);
      c10d::TCPStoreOptions so;
      so.port = static_cast<std::uint16_t>(port);
      so.isServer = true;
      so.waitWorkers = false;
      so.timeout = std::chrono::seconds(30);
      so.masterListenFd = fd;
      world.monitor_store = c10::make_intrusive<c10d::TCPStore>(addr, so);
      std::snprintf(rank0_addr, sizeof(rank0_addr), "%s", addr.c_str());
    }
    check_mpi(MPI_Bcast(&port, 1, MPI_INT, 0, comm), "MPI_Bcast");
    check_mpi(MPI_Bcast(rank0_addr, sizeof(rank0_addr), MPI_CHAR, 0, comm), "MPI_Bcast");
    host = rank0_addr;
  });
  if (world.size > 1 && world.rank != 0) {
    c10d::TCPStoreOptions co;
    co.port = static_cast<std::uint16_t>(port);
    co.isServer = false;
    co.waitWorkers = false;
    co.timeout = std::chrono::seconds(30);
    world.monitor_store = c10::make_intrusive<c10d::TCPStore>(host, co);
  }
  return world;
}

void finalize_mpi() {
  auto& thread = mpi_thread();
  if (!thread || g_mpi_finalized) return;
  bool stuck = false;
  try {
    thread->post([] {
      int finalized = 0;
      MPI_Finalized(&finalized);
      if (!finalized) MPI_Finalize();
      g_mpi_finalized = true;
    });
    stuck = !thread->stop(std::chrono::seconds(20));
  } catch (...) {
    stuck = true;
  }
  if (stuck) {
    fprintf(stderr,
            "[fsdp] MPI_Finalize skipped: a collective is still stuck on the MPI thread "
            "(see the timeout error above)\n");
  }
  thread.reset();
}

void abort_mpi_job(int code) {
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (!initialized || finalized) return;
  // Called from a thread other than the comm thread: MPI_Abort is the one call OpenMPI makes
  // safe for that (it does not wait for the library's progress), and nothing runs after it.
  MPI_Abort(MPI_COMM_WORLD, code);
}

#else  // !FSDP_WITH_MPI

MpiWorld make_mpi_world() {
  TORCH_CHECK(false,
              "[init_process_group] backend 'mpi' is not built in; reconfigure with "
              "-DFSDP_WITH_MPI=ON (needs libopenmpi-dev) or use backend 'gloo'");
}
void finalize_mpi() {}
void abort_mpi_job(int) {}

#endif

}  // namespace fsdp::detail
