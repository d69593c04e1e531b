// What the DDP tests share (tests/test_ddp.cpp, tests/test_ddp_comm_hooks.cpp): a DDPStrategy on a
// run_ranks world group, flattened parameters and the largest difference from rank 0.
#pragma once

#include "fsdp/ddp.h"

#include <torch/torch.h>

#include <memory>
#include <vector>

namespace fsdp::testing {

// The strategy keeps a shared_ptr to its group; run_ranks owns the world group.
inline ProcessGroupPtr borrow(ProcessGroup& pg) {
  return ProcessGroupPtr(&pg, [](ProcessGroup*) {});
}

inline std::shared_ptr<DDPStrategy> make_ddp(ProcessGroup& pg, DDPOptions options = {}) {
  auto ddp = std::make_shared<DDPStrategy>(std::move(options));
  LaunchInfo info;
  info.rank = pg.rank();
  info.world_size = pg.size();
  ddp->connect(borrow(pg), info);
  return ddp;
}

// All parameters flattened into one vector (registration order).
inline at::Tensor flat_params(torch::nn::Module& m) {
  std::vector<at::Tensor> parts;
  for (const auto& p : m.parameters()) parts.push_back(p.detach().reshape(-1));
  return at::cat(parts);
}

// Max |a_r - a_0| over ranks r, computed on every rank.
inline double max_diff_from_rank0(ProcessGroup& pg, const at::Tensor& local) {
  at::Tensor all = at::empty({pg.size() * local.numel()}, local.options());
  pg.all_gather_into_tensor(all, local.contiguous());
  all = all.view({pg.size(), local.numel()});
  return (all - all[0]).abs().max().item<double>();
}

}  // namespace fsdp::testing
