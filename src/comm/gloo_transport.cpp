// Gloo backend: the Gloo library called directly (Debian's libgloo), one gloo::Context per group,
// rendezvous through a c10d::TCPStore hosted by rank 0 at MASTER_ADDR:MASTER_PORT.
// See Note [Gloo backend] in docs/design.md for why this is not c10d's ProcessGroupGloo.
#include "comm/gloo_transport.h"

#include "common/settings.h"

#include <gloo/allgather.h>
#include <gloo/allreduce.h>
#include <gloo/alltoall.h>
#include <gloo/barrier.h>
#include <gloo/broadcast.h>
#include <gloo/math.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/store.h>
#include <gloo/transport/tcp/device.h>

#include <arpa/inet.h>
#include <dlfcn.h>
#include <netdb.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>

namespace fsdp::detail {

namespace {

uint8_t* bytes(const at::Tensor& t) { return static_cast<uint8_t*>(t.data_ptr()); }
size_t nbytes(const at::Tensor& t) { return t.numel() * t.element_size(); }

// Gloo's rendezvous keys live in the job's c10d::TCPStore under a per-group prefix.
class StoreAdapter final : public ::gloo::rendezvous::Store {
 public:
  StoreAdapter(c10::intrusive_ptr<c10d::Store> store, std::string prefix,
               std::chrono::milliseconds timeout)
      : store_(std::move(store)), prefix_(std::move(prefix)), timeout_(timeout) {}

  void set(const std::string& key, const std::vector<char>& data) override {
    store_->set(prefix_ + key, std::vector<uint8_t>(data.begin(), data.end()));
  }
  std::vector<char> get(const std::string& key) override {
    auto value = store_->get(prefix_ + key);
    return {value.begin(), value.end()};
  }
  void wait(const std::vector<std::string>& keys) override { wait(keys, timeout_); }
  void wait(const std::vector<std::string>& keys,
            const std::chrono::milliseconds& timeout) override {
    std::vector<std::string> full;
    full.reserve(keys.size());
    for (const auto& k : keys) full.push_back(prefix_ + k);
    store_->wait(full, timeout);
  }

 private:
  c10::intrusive_ptr<c10d::Store> store_;
  std::string prefix_;
  std::chrono::milliseconds timeout_;
};

template <typename T>
void set_reduction(::gloo::AllreduceOptions& o, ReduceOp op) {
  using Fn = void (*)(void*, const void*, const void*, size_t);
  o.setReduceFunction(op == ReduceOp::kMax ? static_cast<Fn>(&::gloo::max<T>)
                                           : static_cast<Fn>(&::gloo::sum<T>));
}

class GlooTransport final : public Transport {
 public:
  // Collective over the group's members: connects every pair (a full mesh of TCP connections).
  GlooTransport(c10::intrusive_ptr<c10d::Store> root_store, const std::string& prefix, int rank,
                int size, std::shared_ptr<::gloo::transport::Device> device,
                std::chrono::milliseconds timeout)
      : root_store_(std::move(root_store)),
        rank_(rank),
        device_(std::move(device)),
        timeout_(timeout),
        context_(std::make_shared<::gloo::rendezvous::Context>(rank, size)) {
    context_->setTimeout(timeout);
    StoreAdapter store(root_store_, prefix, timeout);
    context_->connectFullMesh(store, device_);
  }

  void all_gather(const at::Tensor& output, const at::Tensor& input) override {
    ::gloo::AllgatherOptions o(context_);
    o.setInput(bytes(input), nbytes(input));
    o.setOutput(bytes(output), nbytes(output));
    configure(o);
    ::gloo::allgather(o);
  }

  void all_to_all(const at::Tensor& output, const at::Tensor& input) override {
    ::gloo::AlltoallOptions o(context_);
    o.setInput(bytes(input), nbytes(input));
    o.setOutput(bytes(output), nbytes(output));
    configure(o);
    ::gloo::alltoall(o);
  }

  void broadcast(const at::Tensor& tensor, int root) override {
    ::gloo::BroadcastOptions o(context_);
    o.setRoot(root);
    o.setOutput(bytes(tensor), nbytes(tensor));  // the root sends from it, the others receive
    configure(o);
    ::gloo::broadcast(o);
  }

  void barrier() override {
    ::gloo::BarrierOptions o(context_);
    configure(o);
    ::gloo::barrier(o);
  }

  bool has_native_all_reduce(at::ScalarType dtype) const override {
    return dtype == at::kFloat || dtype == at::kDouble || dtype == at::kInt ||
           dtype == at::kLong;
  }

  void all_reduce(const at::Tensor& tensor, ReduceOp op) override {
    TORCH_INTERNAL_ASSERT(op == ReduceOp::kSum || op == ReduceOp::kMax);
    ::gloo::AllreduceOptions o(context_);
    switch (tensor.scalar_type()) {
      case at::kFloat:
        o.setOutput(tensor.data_ptr<float>(), tensor.numel());
        set_reduction<float>(o, op);
        break;
      case at::kDouble:
        o.setOutput(tensor.data_ptr<double>(), tensor.numel());
        set_reduction<double>(o, op);
        break;
      case at::kInt:
        o.setOutput(tensor.data_ptr<int32_t>(), tensor.numel());
        set_reduction<int32_t>(o, op);
        break;
      case at::kLong:
        o.setOutput(tensor.data_ptr<int64_t>(), tensor.numel());
        set_reduction<int64_t>(o, op);
        break;
      default:
        TORCH_INTERNAL_ASSERT(false, "gloo all_reduce of ", tensor.scalar_type(),
                              " is emulated by the group");
    }
    configure(o);
    ::gloo::allreduce(o);  // in place: no input set, so the output is also the input
  }

  std::unique_ptr<Transport> split(const std::vector<int>& group_ranks,
                                   const std::string& uid) override {
    auto it = std::find(group_ranks.begin(), group_ranks.end(), rank_);
    if (it == group_ranks.end()) return nullptr;  // Gloo groups need no help from non-members
    int sub_rank = static_cast<int>(it - group_ranks.begin());
    return std::make_unique<GlooTransport>(root_store_, uid + "/", sub_rank,
                                           static_cast<int>(group_ranks.size()), device_,
                                           timeout_);
  }

 private:
  // Every op gets the next tag: ops run in the same order on every member (one comm thread per
  // group), so tags agree, and a late message can never match a later op's slot.
  template <typename Options>
  void configure(Options& o) {
    o.setTag(next_tag_++);
    o.setTimeout(timeout_);
  }

  c10::intrusive_ptr<c10d::Store> root_store_;
  int rank_;
  std::shared_ptr<::gloo::transport::Device> device_;
  std::chrono::milliseconds timeout_;
  std::shared_ptr<::gloo::rendezvous::Context> context_;
  uint32_t next_tag_ = 0;
};

// The local address the kernel would use to reach host:port (no packet is sent: connect() on a
// UDP socket only picks the route). Multi-host runs then listen on the interface that faces
// the master, whatever the machine's hostname resolves to.
std::string local_address_towards(const std::string& host, int port) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* res = nullptr;
  const int rc = getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &res);
  TORCH_CHECK(rc == 0, "[init_process_group] cannot resolve MASTER_ADDR '", host,
              "': ", gai_strerror(rc));
  std::string out;
  for (addrinfo* ai = res; ai && out.empty(); ai = ai->ai_next) {
    const int fd = socket(ai->ai_family, ai->ai_socktype, 0);
    if (fd < 0) continue;
    sockaddr_storage local{};
    socklen_t len = sizeof(local);
    if (connect(fd, ai->ai_addr, ai->ai_addrlen) == 0 &&
        getsockname(fd, reinterpret_cast<sockaddr*>(&local), &len) == 0) {
      char text[INET6_ADDRSTRLEN] = {};
      const void* addr = local.ss_family == AF_INET
                             ? static_cast<const void*>(&reinterpret_cast<sockaddr_in*>(&local)->sin_addr)
                             : static_cast<const void*>(&reinterpret_cast<sockaddr_in6*>(&local)->sin6_addr);
      if (inet_ntop(local.ss_family, addr, text, sizeof(text))) out = text;
    }
    close(fd);
  }
  freeaddrinfo(res);
  TORCH_CHECK(!out.empty(), "[init_process_group] no local interface routes to MASTER_ADDR '",
              host, "'; set GLOO_SOCKET_IFNAME to the interface the ranks should use");
  return out;
}

// See Note [Gloo backend]: libtorch carries a private copy of Gloo whose symbols it exports.
// Our calls must reach the Gloo our headers describe, or objects are laid out differently on
// each side of a call. Checked once, before the first Gloo object is made.
void check_gloo_symbols() {
  static const std::string problem = [] {
    auto library_of = [](void* fn) {
      Dl_info info{};
      return dladdr(fn, &info) && info.dli_fname ? std::string(info.dli_fname) : std::string();
    };
    const std::string lib = library_of(reinterpret_cast<void*>(&::gloo::allgather));
    const std::string dev = library_of(reinterpret_cast<void*>(&::gloo::transport::tcp::CreateDevice));
    if (lib.find("libgloo") != std::string::npos && dev.find("libgloo") != std::string::npos) {
      return std::string();
    }
    return "gloo::allgather resolves into '" + lib + "' and gloo::transport::tcp::CreateDevice "
           "into '" + dev + "', not into Debian's libgloo.so";
  }();
  TORCH_CHECK(problem.empty(), "[gloo] ", problem,
              ". libtorch exports its own, different copy of Gloo; libgloo must come before "
              "libtorch in the program's link order.\n---> HINT: link fsdp::fsdp (or Debian's "
              "gloo target) before ${TORCH_LIBRARIES}; see Note [Gloo backend] in docs/design.md");
}

std::shared_ptr<::gloo::transport::Device> make_device(const std::string& master_addr,
                                                       int master_port) {
  ::gloo::transport::tcp::attr attr;
  if (const std::string ifname = read_settings().gloo_socket_ifname; !ifname.empty()) {
    attr.iface = ifname;
  } else if (is_loopback(master_addr)) {
    attr.hostname = "127.0.0.1";
  } else {
    attr.hostname = local_address_towards(master_addr, master_port);
  }
  try {
    return ::gloo::transport::tcp::CreateDevice(attr);
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "[init_process_group] gloo cannot open a TCP device on ",
                attr.iface.empty() ? attr.hostname : "interface " + attr.iface, ": ", e.what(),
                "\n---> HINT: set GLOO_SOCKET_IFNAME to an interface that reaches the other "
                "ranks");
  }
}

}  // namespace

GlooWorld make_gloo_world(const GlooWorldOptions& options) {
  check_gloo_symbols();
  RendezvousOptions ro = options.rendezvous;
  ro.local_address = is_loopback(ro.master_addr) ? "127.0.0.1"
                                                 : local_address_towards(ro.master_addr, ro.master_port);
  Rendezvous rv = rendezvous(ro);
  auto device = make_device(ro.master_addr, ro.master_port);
  GlooWorld world;
  try {
    world.transport = std::make_unique<GlooTransport>(rv.store, "world/", ro.rank, ro.size,
                                                      device, options.timeout);
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "[init_process_group] rank ", ro.rank, " could not connect to the ",
                ro.size - 1, " other ranks over gloo (device ", device->str(), "): ", e.what());
  }
  // The rendezvous store must outlive the groups: GlooTransport keeps root_store_.
  world.monitor_store = rv.monitor_store;
  return world;
}

}  // namespace fsdp::detail
