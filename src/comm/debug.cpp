#include "comm/debug.h"

#include <cstdlib>
#include <sstream>

namespace fsdp::detail {

// Note [Collective fingerprints]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// With FSDP_DEBUG=detail, the comm thread runs one extra all-gather of 5 int64 per rank
// {op, seq, dtype, numel, arg} before the real collective. Every rank does this exchange first
// for every collective, so the exchanges pair up even when the real calls differ (which is the
// bug being caught). All ranks see the same table, compare every rank against rank 0 and throw
// the same text, before any data moved: the group stays usable. The cost is one tiny collective
// per call, which is why it is opt-in.

namespace {
constexpr int64_t kFields = 5;
}

std::string describe_fingerprint(const CollectiveFingerprint& fp) {
  std::ostringstream out;
  out << to_string(fp.op) << " #" << fp.seq;
  switch (fp.op) {
    case CollectiveOp::kBarrier:
      break;
    case CollectiveOp::kNewSubgroup:
      out << " of " << fp.numel << " ranks (hash " << fp.arg << ")";
      break;
    default:
      out << " [" << fp.numel << "] " << dtype_name(fp.dtype);
      if (fp.op == CollectiveOp::kBroadcast) out << " root " << fp.arg;
      if (fp.op == CollectiveOp::kAllReduce || fp.op == CollectiveOp::kReduceScatter) {
        out << " " << fsdp::to_string(static_cast<ReduceOp>(fp.arg));
      }
  }
  return out.str();
}

std::optional<std::string> check_same_collective(Transport& transport, int group_size,
                                                 const CollectiveFingerprint& mine,
                                                 const std::vector<int>& world_ranks) {
  auto input = at::empty({kFields}, at::kLong);
  auto* in = input.data_ptr<int64_t>();
  in[0] = static_cast<int64_t>(mine.op);
  in[1] = mine.seq;
  in[2] = static_cast<int64_t>(mine.dtype);
  in[3] = mine.numel;
  in[4] = mine.arg;
  auto table = at::empty({group_size * kFields}, at::kLong);
  transport.all_gather(table, input);
  const auto* t = table.data_ptr<int64_t>();
  auto row = [&](int r) {
    CollectiveFingerprint fp;
    fp.op = static_cast<CollectiveOp>(t[r * kFields + 0]);
    fp.seq = t[r * kFields + 1];
    fp.dtype = static_cast<at::ScalarType>(t[r * kFields + 2]);
    fp.numel = t[r * kFields + 3];
    fp.arg = t[r * kFields + 4];
    return fp;
  };
  for (int r = 1; r < group_size; ++r) {
    bool same = true;
    for (int64_t f = 0; f < kFields; ++f) same = same && t[r * kFields + f] == t[f];
    if (!same) {
      std::ostringstream out;
      out << "[FSDP_DEBUG=detail] collective mismatch: rank " << world_ranks[0] << " called "
          << describe_fingerprint(row(0)) << " but rank " << world_ranks[r] << " called "
          << describe_fingerprint(row(r))
          << ". Every rank of a group must call the same collectives, with the same sizes and "
             "dtypes, in the same order.";
      return out.str();
    }
  }
  return std::nullopt;
}

}  // namespace fsdp::detail
