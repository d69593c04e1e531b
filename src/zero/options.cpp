// DeepSpeed names and options: Lightning's registry names, the option checks, and the DeepSpeed
// JSON config parser (one place for each: docs/design.md, "Decisions").
#include "common/limits.h"
#include "common/text.h"
#include "offload/aio.h"
#include "fsdp/deepspeed.h"

#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>

#include <cmath>
#include <cstdlib>
#include <fstream>
#include <sstream>

namespace fsdp {

using json = nlohmann::json;

namespace {

struct NamedPreset {
  const char* name;
  int stage;
  bool offload;   // offload_optimizer (+ offload_parameters at stage 3)
  bool nvme;
};

// Lightning's StrategyRegistry entries for DeepSpeed (strategies/deepspeed.py register_strategies).
const std::vector<NamedPreset>& presets() {
  static const std::vector<NamedPreset> p = {
      {"deepspeed", 2, false, false},
      {"deepspeed_stage_1", 1, false, false},
      {"deepspeed_stage_2", 2, false, false},
      {"deepspeed_stage_2_offload", 2, true, false},
      {"deepspeed_stage_3", 3, false, false},
      {"deepspeed_stage_3_offload", 3, true, false},
      {"deepspeed_stage_3_offload_nvme", 3, true, true},
  };
  return p;
}

// --- the JSON config --------------------------------------------------------------------------

// Note [DeepSpeed config keys]
// Only the keys below are accepted; any other key (DeepSpeed has hundreds) is an error naming
// it and listing these, rather than a setting silently ignored. A value of the wrong JSON type
// is an error naming the key, the expected type and the value.
const std::vector<std::string> kTopKeys = {
    "zero_optimization", "bf16", "gradient_clipping", "gradient_accumulation_steps",
    "train_micro_batch_size_per_gpu", "optimizer", "scheduler", "zero_allow_untested_optimizer",
    "activation_checkpointing", "aio"};
const std::vector<std::string> kZeroKeys = {
    "stage", "offload_optimizer", "offload_param", "contiguous_gradients", "overlap_comm",
    "allgather_partitions", "reduce_scatter", "allgather_bucket_size", "reduce_bucket_size",
    "sub_group_size", "stage3_param_persistence_threshold", "stage3_prefetch_bucket_size",
    "stage3_max_live_parameters"};
const std::vector<std::string> kOffloadOptimizerKeys = {"device", "pin_memory", "nvme_path",
                                                        "buffer_count"};
const std::vector<std::string> kAioKeys = {"block_size", "queue_depth", "intra_op_parallelism",
                                           "single_submit", "overlap_events", "use_gds"};
const std::vector<std::string> kOffloadParamKeys = {"device",      "pin_memory", "nvme_path",
                                                    "buffer_count", "buffer_size", "max_in_cpu"};
const std::vector<std::string> kBf16Keys = {"enabled"};
const std::vector<std::string> kOptimizerKeys = {"type", "params"};
const std::vector<std::string> kOptimizerParamKeys = {"lr", "betas", "eps", "weight_decay",
                                                      "adam_w_mode"};
const std::vector<std::string> kSchedulerKeys = {"type", "params"};
const std::vector<std::string> kSchedulerParamKeys = {"warmup_min_lr", "warmup_max_lr",
                                                      "warmup_num_steps", "warmup_type",
                                                      "total_num_steps", "last_batch_iteration"};
const std::vector<std::string> kActivationKeys = {"partition_activations", "cpu_checkpointing"};

// Note [DeepSpeed config numbers]
// Every number is checked against its range as written, before it is converted: an integer key
// takes a JSON integer or a whole-valued float (2e8) in [lo, hi], never a value that would wrap
// in a narrower type ("stage": 4294967298 is not stage 2); a real-valued key takes a finite
// number in its range (a learning rate of 1e308 is refused, not trained to a nan loss). The
// error names the key, the range and the value. Element counts are at most 2^53
// (detail::kMaxExactInteger), exact in the doubles DeepSpeedOptions keeps them in.
constexpr int64_t kMax = detail::kMaxExactInteger;
constexpr double kMaxNumber = 1e15;            // weight_decay, gradient_clipping
constexpr int64_t kMaxBuffers = 1 << 20;       // offload buffer_count
constexpr int64_t kMaxAccumulation = 1 << 30;  // gradient_accumulation_steps, micro-batch size

class ConfigReader {
 public:
  explicit ConfigReader(std::string source) : source_(std::move(source)) {}

  void check_keys(const json& obj, const std::string& where, const std::vector<std::string>& ok) {
    expect(obj.is_object(), where, "an object", obj);
    for (const auto& [key, value] : obj.items()) {
      bool known = false;
      for (const auto& k : ok) known = known || k == key;
      TORCH_CHECK(known, "[deepspeed config] ", source_, ": unknown or unsupported key '",
                  path(where, key), "'; supported keys", where.empty() ? "" : " in '" + where + "'",
                  ": ", detail::quoted_list(ok),
                  ". Other DeepSpeed settings are not implemented by fsdp.cpp.");
    }
  }
  bool boolean(const json& obj, const std::string& where, const char* key, bool fallback) {
    if (!obj.contains(key)) return fallback;
    const json& v = obj.at(key);
    expect(v.is_boolean(), path(where, key), "a boolean", v);
    return v.get<bool>();
  }
  // A finite number in [lo, hi] (above lo, not equal, when `above`). See Note [DeepSpeed config
  // numbers].
  double number(const json& obj, const std::string& where, const char* key, double fallback,
                double lo, double hi, bool above = false) {
    if (!obj.contains(key)) return fallback;
    const json& v = obj.at(key);
    const std::string range = (above ? "a number above " + show(lo) + " and at most "
                                     : "a number from " + show(lo) + " to ") + show(hi);
    expect(v.is_number(), path(where, key), range, v);
    const double d = v.get<double>();
    expect(std::isfinite(d) && (above ? d > lo : d >= lo) && d <= hi, path(where, key), range, v);
    return d;
  }
  // A whole number in [lo, hi]: a JSON integer, or a whole-valued float (2e8 is written as a
  // float in most configs). The range is checked on the value as written, before any
  // conversion, so nothing wraps. See Note [DeepSpeed config numbers].
  int64_t integer(const json& obj, const std::string& where, const char* key, int64_t fallback,
                  int64_t lo, int64_t hi) {
    if (!obj.contains(key)) return fallback;
    const json& v = obj.at(key);
    TORCH_INTERNAL_ASSERT(lo <= hi && hi <= detail::kMaxExactInteger &&
                          lo >= -detail::kMaxExactInteger);
    const std::string range = "an integer from " + show(lo) + " to " + show(hi);
    expect(v.is_number(), path(where, key), range, v);
    bool ok = false;
    int64_t out = 0;
    if (v.is_number_unsigned()) {
      const uint64_t u = v.get<uint64_t>();
      ok = u <= static_cast<uint64_t>(hi) && (lo <= 0 || u >= static_cast<uint64_t>(lo));
      out = ok ? static_cast<int64_t>(u) : 0;
    } else if (v.is_number_integer()) {
      out = v.get<int64_t>();
      ok = out >= lo && out <= hi;
    } else {
      const double d = v.get<double>();
      ok = std::isfinite(d) && d == std::floor(d) && d >= static_cast<double>(lo) &&
           d <= static_cast<double>(hi);
      out = ok ? static_cast<int64_t>(d) : 0;
    }
    expect(ok, path(where, key), range, v);
    return out;
  }
  std::string string(const json& obj, const std::string& where, const char* key,
                     const std::string& fallback) {
    if (!obj.contains(key)) return fallback;
    const json& v = obj.at(key);
    expect(v.is_string(), path(where, key), "a string", v);
    return v.get<std::string>();
  }
  const json* object(const json& obj, const std::string& where, const char* key) {
    if (!obj.contains(key)) return nullptr;
    const json& v = obj.at(key);
    expect(v.is_object(), path(where, key), "an object", v);
    return &v;
  }
  void expect(bool ok, const std::string& key, const std::string& type, const json& value) {
    TORCH_CHECK(ok, "[deepspeed config] ", source_, ": '", key, "' must be ", type, ", got ",
                value.dump());
  }
  static std::string show(double v) {
    std::ostringstream out;
    out << v;
    return out.str();
  }
  static std::string show(int64_t v) { return std::to_string(v); }
  static std::string path(const std::string& where, const std::string& key) {
    return where.empty() ? key : where + "." + key;
  }
  const std::string& source() const { return source_; }

 private:
  std::string source_;
};

json load_config_json(const std::string& path_or_json, std::string* source) {
  size_t first = path_or_json.find_first_not_of(" \t\r\n");
  std::string text;
  if (first != std::string::npos && path_or_json[first] == '{') {
    *source = "config object";
    text = path_or_json;
  } else {
    *source = path_or_json;
    std::ifstream in(path_or_json);
    TORCH_CHECK(in, "[deepspeed config] cannot open '", path_or_json,
                "': pass a DeepSpeed JSON config file (or the JSON object itself)");
    std::stringstream ss;
    ss << in.rdbuf();
    text = ss.str();
  }
  // The JSON reader stops at a NUL byte: whatever follows it would be ignored unread.
  const size_t nul = text.find('\0');
  TORCH_CHECK(nul == std::string::npos, "[deepspeed config] ", *source, " holds a NUL byte at "
              "offset ", nul, ": a DeepSpeed config is JSON text");
  json j = json::parse(text, nullptr, /*allow_exceptions=*/false);
  TORCH_CHECK(!j.is_discarded(), "[deepspeed config] ", *source, " is not valid JSON");
  TORCH_CHECK(j.is_object(), "[deepspeed config] ", *source, " must be a JSON object");
  return j;
}

const json* read_offload_device(ConfigReader& r, const json& zero, const char* key,
                                const std::vector<std::string>& keys, bool* enabled,
                                std::string* device, std::string* nvme_path, bool* pin_memory) {
  const json* off = r.object(zero, "zero_optimization", key);
  if (!off) return nullptr;
  const std::string where = std::string("zero_optimization.") + key;
  r.check_keys(*off, where, keys);
  const std::string dev = r.string(*off, where, "device", "none");
  TORCH_CHECK(dev == "none" || dev == "cpu" || dev == "nvme", "[deepspeed config] ", r.source(),
              ": '", where, ".device' must be \"none\", \"cpu\" or \"nvme\", got \"", dev, "\"");
  *enabled = dev != "none";
  if (*enabled) *device = dev;
  *nvme_path = r.string(*off, where, "nvme_path", *nvme_path);
  *pin_memory = r.boolean(*off, where, "pin_memory", *pin_memory);
  return off;
}

// DeepSpeed's "aio" block (swap_tensor/constants.py defaults, kept by AioOptions).
AioOptions read_aio(ConfigReader& r, const json& j) {
  AioOptions a;
  const json* aio = r.object(j, "", "aio");
  if (!aio) return a;
  r.check_keys(*aio, "aio", kAioKeys);
  a.block_size = r.integer(*aio, "aio", "block_size", a.block_size, detail::kAioAlignment,
                           detail::kAioMaxBlockSize);
  // In range of int: the bounds are the engine's (src/offload/aio.h).
  a.queue_depth = static_cast<int>(
      r.integer(*aio, "aio", "queue_depth", a.queue_depth, 1, detail::kAioMaxQueueDepth));
  a.intra_op_parallelism = static_cast<int>(r.integer(*aio, "aio", "intra_op_parallelism",
                                                      a.intra_op_parallelism, 1,
                                                      detail::kAioMaxIntraOpParallelism));
  a.single_submit = r.boolean(*aio, "aio", "single_submit", a.single_submit);
  a.overlap_events = r.boolean(*aio, "aio", "overlap_events", a.overlap_events);
  a.use_gds = r.boolean(*aio, "aio", "use_gds", a.use_gds);
  return a;
}

}  // namespace

DeepSpeedOptions parse_deepspeed_config(const std::string& path_or_json,
                                        DeepSpeedTrainingConfig* training) {
  std::string source;
  const json j = load_config_json(path_or_json, &source);
  ConfigReader r(source);
  r.check_keys(j, "", kTopKeys);

  // A config replaces the defaults (Lightning): DeepSpeed's own defaults for what it leaves out
  // (runtime/zero/config.py), not Lightning's constructor defaults.
  DeepSpeedOptions o;
  o.config = path_or_json;
  o.stage = 0;
  o.allgather_bucket_size = 5e8;
  o.reduce_bucket_size = 5e8;
  o.sub_group_size = 1e9;
  o.zero_allow_untested_optimizer = r.boolean(j, "", "zero_allow_untested_optimizer", false);
  if (const json* z = r.object(j, "", "zero_optimization")) {
    r.check_keys(*z, "zero_optimization", kZeroKeys);
    const std::string w = "zero_optimization";
    o.stage = static_cast<int>(r.integer(*z, w, "stage", 0, 0, 3));  // 0: refused with a hint
    o.contiguous_gradients = r.boolean(*z, w, "contiguous_gradients", true);
    // DeepSpeed: overlap_comm None -> true only for stage 3.
    o.overlap_comm = r.boolean(*z, w, "overlap_comm", o.stage == 3);
    o.allgather_partitions = r.boolean(*z, w, "allgather_partitions", true);
    o.reduce_scatter = r.boolean(*z, w, "reduce_scatter", true);
    o.allgather_bucket_size =
        static_cast<double>(r.integer(*z, w, "allgather_bucket_size", 500000000, 1, kMax));
    o.reduce_bucket_size =
        static_cast<double>(r.integer(*z, w, "reduce_bucket_size", 500000000, 1, kMax));
    o.sub_group_size = static_cast<double>(r.integer(*z, w, "sub_group_size", 1000000000, 1, kMax));
    o.stage3_param_persistence_threshold =
        r.integer(*z, w, "stage3_param_persistence_threshold", 100000, 0, kMax);
    o.stage3_prefetch_bucket_size =
        r.integer(*z, w, "stage3_prefetch_bucket_size", 50000000, 0, kMax);
    o.stage3_max_live_parameters =
        r.integer(*z, w, "stage3_max_live_parameters", 1000000000, 1, kMax);
    const std::string wo = "zero_optimization.offload_optimizer";
    if (const json* off = read_offload_device(r, *z, "offload_optimizer", kOffloadOptimizerKeys,
                                              &o.offload_optimizer, &o.offload_optimizer_device,
                                              &o.nvme_path, &o.pin_memory)) {
      o.optimizer_buffer_count =
          r.integer(*off, wo, "buffer_count", o.optimizer_buffer_count, 1, kMaxBuffers);
    }
    const std::string wp = "zero_optimization.offload_param";
    if (const json* off = read_offload_device(r, *z, "offload_param", kOffloadParamKeys,
                                              &o.offload_parameters, &o.offload_params_device,
                                              &o.nvme_path, &o.pin_memory)) {
      o.params_buffer_count =
          r.integer(*off, wp, "buffer_count", o.params_buffer_count, 1, kMaxBuffers);
      o.params_buffer_size = static_cast<double>(r.integer(
          *off, wp, "buffer_size", static_cast<int64_t>(o.params_buffer_size), 1, kMax));
      o.max_in_cpu = static_cast<double>(
          r.integer(*off, wp, "max_in_cpu", static_cast<int64_t>(o.max_in_cpu), 0, kMax));
    }
  }
  o.aio = read_aio(r, j);
  if (const json* a = r.object(j, "", "activation_checkpointing")) {
    r.check_keys(*a, "activation_checkpointing", kActivationKeys);
    o.partition_activations = r.boolean(*a, "activation_checkpointing", "partition_activations", false);
    o.cpu_checkpointing = r.boolean(*a, "activation_checkpointing", "cpu_checkpointing", false);
  }

  DeepSpeedTrainingConfig t;
  if (const json* b = r.object(j, "", "bf16")) {
    r.check_keys(*b, "bf16", kBf16Keys);
    if (r.boolean(*b, "bf16", "enabled", false)) t.precision = "bf16-mixed";
  }
  if (j.contains("gradient_clipping")) {
    t.gradient_clipping = r.number(j, "", "gradient_clipping", 0, 0, kMaxNumber);  // 0: off
  }
  if (j.contains("gradient_accumulation_steps")) {
    t.gradient_accumulation_steps =
        r.integer(j, "", "gradient_accumulation_steps", 1, 1, kMaxAccumulation);
  }
  if (j.contains("train_micro_batch_size_per_gpu")) {
    t.train_micro_batch_size_per_gpu =
        r.integer(j, "", "train_micro_batch_size_per_gpu", 1, 1, kMaxAccumulation);
  }
  if (const json* opt = r.object(j, "", "optimizer")) {
    r.check_keys(*opt, "optimizer", kOptimizerKeys);
    t.optimizer_type = r.string(*opt, "optimizer", "type", "");
    TORCH_CHECK(t.optimizer_type == "Adam" || t.optimizer_type == "AdamW", "[deepspeed config] ",
                source, ": 'optimizer.type' \"", t.optimizer_type,
                "\" is not supported; supported: \"Adam\", \"AdamW\"");
    if (const json* p = r.object(*opt, "optimizer", "params")) {
      r.check_keys(*p, "optimizer.params", kOptimizerParamKeys);
      t.lr = r.number(*p, "optimizer.params", "lr", t.lr, 0, detail::kMaxLearningRate, true);
      t.eps = r.number(*p, "optimizer.params", "eps", t.eps, 0, 1, true);
      t.weight_decay =
          r.number(*p, "optimizer.params", "weight_decay", t.weight_decay, 0, kMaxNumber);
      t.adam_w_mode = r.boolean(*p, "optimizer.params", "adam_w_mode", t.adam_w_mode);
      if (p->contains("betas")) {
        const json& b = p->at("betas");
        const char* betas = "an array of two numbers from 0 to 1 (1 excluded)";
        r.expect(b.is_array() && b.size() == 2 && b[0].is_number() && b[1].is_number(),
                 "optimizer.params.betas", betas, b);
        t.beta1 = b[0].get<double>();
        t.beta2 = b[1].get<double>();
        r.expect(t.beta1 >= 0 && t.beta1 < 1 && t.beta2 >= 0 && t.beta2 < 1,
                 "optimizer.params.betas", betas, b);
      }
    }
  }
  if (const json* s = r.object(j, "", "scheduler")) {
    r.check_keys(*s, "scheduler", kSchedulerKeys);
    t.scheduler_type = r.string(*s, "scheduler", "type", "");
    TORCH_CHECK(t.scheduler_type == "WarmupLR" || t.scheduler_type == "WarmupDecayLR",
                "[deepspeed config] ", source, ": 'scheduler.type' \"", t.scheduler_type,
                "\" is not supported; supported: \"WarmupLR\", \"WarmupDecayLR\"");
    if (const json* p = r.object(*s, "scheduler", "params")) {
      const std::string w = "scheduler.params";
      r.check_keys(*p, w, kSchedulerParamKeys);
      t.warmup_min_lr =
          r.number(*p, w, "warmup_min_lr", t.warmup_min_lr, 0, detail::kMaxLearningRate);
      t.warmup_max_lr =
          r.number(*p, w, "warmup_max_lr", t.warmup_max_lr, 0, detail::kMaxLearningRate);
      t.warmup_num_steps = r.integer(*p, w, "warmup_num_steps", t.warmup_num_steps, 0, kMax);
      t.warmup_type = r.string(*p, w, "warmup_type", t.warmup_type);
      TORCH_CHECK(t.warmup_type == "log" || t.warmup_type == "linear", "[deepspeed config] ",
                  source, ": 'scheduler.params.warmup_type' must be \"log\" or \"linear\", got \"",
                  t.warmup_type, "\"");
      t.total_num_steps = r.integer(*p, w, "total_num_steps", 0, 0, kMax);
      const int64_t last = r.integer(*p, w, "last_batch_iteration", -1, -kMax, kMax);
      TORCH_CHECK(last == -1, "[deepspeed config] ", source, ": 'scheduler.params."
                  "last_batch_iteration' other than -1 is not supported (resume restores the "
                  "scheduler from the checkpoint instead)");
    }
    TORCH_CHECK(t.scheduler_type != "WarmupDecayLR" || t.total_num_steps > 0,
                "[deepspeed config] ", source, ": WarmupDecayLR needs "
                "'scheduler.params.total_num_steps' > 0");
  }
  if (training) *training = t;
  return o;
}

std::vector<std::string> deepspeed_strategy_names() {
  std::vector<std::string> names;
  for (const auto& p : presets()) names.emplace_back(p.name);
  return names;
}

std::shared_ptr<DeepSpeedStrategy> make_deepspeed_strategy(const std::string& name,
                                                           DeepSpeedOptions options) {
  for (const auto& p : presets()) {
    if (name != p.name) continue;
    if (name != "deepspeed") options.stage = p.stage;
    if (p.offload) {
      options.offload_optimizer = true;
      if (p.stage == 3) options.offload_parameters = true;
    }
    if (p.nvme) {
      options.remote_device = "nvme";
      options.offload_params_device = "nvme";
      options.offload_optimizer_device = "nvme";
    }
    auto s = std::make_shared<DeepSpeedStrategy>(options);
    s->set_name(name);
    return s;
  }
  TORCH_CHECK(false, "[make_deepspeed_strategy] unknown strategy '", name, "'; valid names: ",
              detail::quoted_list(deepspeed_strategy_names()));
}

}  // namespace fsdp
