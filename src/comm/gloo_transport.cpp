#include "comm/gloo_transport.h"

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <cstdlib>

namespace fsdp::detail {

namespace {

// Gloo knows float, double, half, int8, uint8, int32, int64. Other dtypes travel bit-cast as
// the Gloo dtype of the same element size. See Note [bf16 travel].
at::Tensor wire(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat:
    case at::kDouble:
    case at::kHalf:
    case at::kChar:
    case at::kByte:
    case at::kInt:
    case at::kLong:
      return t;
    default:
      break;
  }
  switch (t.element_size()) {
    case 1:
      return t.view(at::kByte);
    case 2:
      return t.view(at::kHalf);
    case 4:
      return t.view(at::kInt);
    case 8:
      return t.view(at::kLong);
    default:
      TORCH_CHECK(false, "[gloo] cannot move ", t.scalar_type(), " tensors");
  }
}

bool is_loopback(const std::string& host) {
  return host == "localhost" || host.rfind("127.", 0) == 0 || host == "::1";
}

class GlooTransport final : public Transport {
 public:
  GlooTransport(c10::intrusive_ptr<c10d::Store> root_store, const std::string& prefix, int rank,
                int size, std::shared_ptr<::gloo::transport::Device> device,
                std::chrono::milliseconds timeout)
      : root_store_(std::move(root_store)),
        rank_(rank),
        size_(size),
        device_(std::move(device)),
        timeout_(timeout) {
    auto opts = c10d::ProcessGroupGloo::Options::create(timeout);
    opts->devices.push_back(device_);
    // One Gloo worker is enough: our comm thread runs one collective at a time per group.
    opts->threads = 1;
    auto store = c10::make_intrusive<c10d::PrefixStore>(prefix, root_store_);
    pg_ = c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, size, opts);
  }

  void all_gather(const at::Tensor& output, const at::Tensor& input) override {
    std::vector<at::Tensor> inputs{wire(input)};
    auto out = wire(output).view({size_, input.numel()});
    std::vector<std::vector<at::Tensor>> outputs(1);
    for (int i = 0; i < size_; ++i) outputs[0].push_back(out[i]);
    c10d::AllgatherOptions o;
    o.timeout = timeout_;
    pg_->allgather(outputs, inputs, o)->wait();
  }

  void all_to_all(const at::Tensor& output, const at::Tensor& input) override {
    auto out = wire(output);
    auto in = wire(input);
    std::vector<int64_t> equal_splits;
    c10d::AllToAllOptions o;
    o.timeout = timeout_;
    pg_->alltoall_base(out, in, equal_splits, equal_splits, o)->wait();
  }

  void broadcast(const at::Tensor& tensor, int root) override {
    std::vector<at::Tensor> tensors{wire(tensor)};
    c10d::BroadcastOptions o;
    o.rootRank = root;
    o.timeout = timeout_;
    pg_->broadcast(tensors, o)->wait();
  }

  void barrier() override {
    c10d::BarrierOptions o;
    o.timeout = timeout_;
    pg_->barrier(o)->wait();
  }

  bool has_native_all_reduce(at::ScalarType dtype) const override {
    return dtype == at::kFloat || dtype == at::kDouble || dtype == at::kInt ||
           dtype == at::kLong;
  }

  void all_reduce(const at::Tensor& tensor, ReduceOp op) override {
    TORCH_INTERNAL_ASSERT(op == ReduceOp::kSum || op == ReduceOp::kMax);
    std::vector<at::Tensor> tensors{tensor};
    c10d::AllreduceOptions o;
    o.reduceOp = op == ReduceOp::kMax ? c10d::ReduceOp::MAX : c10d::ReduceOp::SUM;
    o.timeout = timeout_;
    pg_->allreduce(tensors, o)->wait();
  }

  // Gloo 1.13 has no reduce-scatter: see Note [Reduce-scatter emulation].
  bool has_native_reduce_scatter(at::ScalarType) const override { return false; }
  void reduce_scatter(const at::Tensor&, const at::Tensor&, ReduceOp) override {
    TORCH_INTERNAL_ASSERT(false, "gloo has no native reduce-scatter");
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
  c10::intrusive_ptr<c10d::Store> root_store_;
  int rank_;
  int size_;
  std::shared_ptr<::gloo::transport::Device> device_;
  std::chrono::milliseconds timeout_;
  c10::intrusive_ptr<c10d::ProcessGroupGloo> pg_;
};

}  // namespace

GlooWorld make_gloo_world(const GlooWorldOptions& options) {
  TORCH_CHECK(options.master_port > 0 && options.master_port < 65536,
              "[init_process_group] gloo backend at world size ", options.size,
              " needs MASTER_PORT (got ", options.master_port,
              "); start the ranks with fsdp-run, or set MASTER_ADDR and MASTER_PORT");
  // Rendezvous can wait for slow-starting ranks longer than one collective may take.
  auto store_timeout = std::max<std::chrono::milliseconds>(options.timeout, std::chrono::minutes(1));
  c10d::TCPStoreOptions so;
  so.port = static_cast<std::uint16_t>(options.master_port);
  so.isServer = options.rank == 0;
  so.numWorkers = options.size;
  so.waitWorkers = true;
  so.timeout = store_timeout;
  c10::intrusive_ptr<c10d::Store> store;
  try {
    store = c10::make_intrusive<c10d::TCPStore>(options.master_addr, so);
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "[init_process_group] rank ", options.rank,
                " could not rendezvous at MASTER_ADDR:MASTER_PORT = ", options.master_addr, ":",
                options.master_port, " (world size ", options.size, "): ", e.what(),
                "\n---> HINT: is rank 0 running and the port free? All ranks must use the same "
                "MASTER_ADDR/MASTER_PORT.");
  }
  std::shared_ptr<::gloo::transport::Device> device;
  if (const char* ifname = std::getenv("GLOO_SOCKET_IFNAME")) {
    device = c10d::ProcessGroupGloo::createDeviceForInterface(ifname);
  } else if (is_loopback(options.master_addr)) {
    device = c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1");
  } else {
    device = c10d::ProcessGroupGloo::createDefaultDevice();
  }
  GlooWorld world;
  world.transport = std::make_unique<GlooTransport>(store, "world/", options.rank, options.size,
                                                    device, options.timeout);
  c10d::TCPStoreOptions mo;
  mo.port = so.port;
  mo.isServer = false;
  mo.waitWorkers = false;
  mo.timeout = std::chrono::seconds(10);
  world.monitor_store = c10::make_intrusive<c10d::TCPStore>(options.master_addr, mo);
  // The rendezvous store must outlive the groups: GlooTransport keeps root_store_.
  return world;
}

}  // namespace fsdp::detail
