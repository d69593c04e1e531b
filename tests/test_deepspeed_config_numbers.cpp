// DeepSpeed JSON numbers: every integer is range-checked as written (nothing wraps in a
// narrower type), every real number is finite and in its range, and the file is JSON text to
// its end. See Note [DeepSpeed config numbers] in src/zero/options.cpp.
#include <gtest/gtest.h>

#include "fsdp/deepspeed.h"
#include "testing.h"

#include <unistd.h>

#include <filesystem>
#include <fstream>

namespace {

using fsdp::testing::error_of;

std::string refusal(const std::string& config) {
  return error_of([&] { fsdp::parse_deepspeed_config(config); });
}

// The config is refused with a message naming `key`, the accepted range and the value.
void expect_refused(const std::string& config, const std::string& key, const std::string& range,
                    const std::string& value) {
  const std::string e = refusal(config);
  EXPECT_NE(e.find("'" + key + "' must be " + range + ", got " + value), std::string::npos)
      << config << "\n" << e;
  EXPECT_EQ(e.find('\n'), std::string::npos) << "one line: " << e;
}

TEST(DeepSpeedConfigNumbers, IntegersThatWouldWrapAreRefused) {
  // 4294967298 = 2^32 + 2: static_cast<int> made it stage 2.
  expect_refused(R"({"zero_optimization": {"stage": 4294967298}})", "zero_optimization.stage",
                 "an integer from 0 to 3", "4294967298");
  // 4294967304 = 2^32 + 8: became queue depth 8.
  expect_refused(R"({"aio": {"queue_depth": 4294967304}})", "aio.queue_depth",
                 "an integer from 1 to 4096", "4294967304");
  expect_refused(R"({"aio": {"intra_op_parallelism": -1}})", "aio.intra_op_parallelism",
                 "an integer from 1 to 64", "-1");
  expect_refused(R"({"aio": {"block_size": 100}})", "aio.block_size",
                 "an integer from 4096 to 1073741824", "100");
  // Beyond int64_t, and beyond uint64_t (nlohmann reads it as a float).
  expect_refused(R"({"zero_optimization": {"stage": 18446744073709551615}})",
                 "zero_optimization.stage", "an integer from 0 to 3", "18446744073709551615");
  expect_refused(R"({"zero_optimization": {"reduce_bucket_size": 1e300}})",
                 "zero_optimization.reduce_bucket_size", "an integer from 1 to 9007199254740992",
                 "1e+300");
  expect_refused(
      R"({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu", "buffer_size": 1.2e19}}})",
      "zero_optimization.offload_param.buffer_size", "an integer from 1 to 9007199254740992",
      "1.2e+19");
  expect_refused(R"({"zero_optimization": {"stage": 2.5}})", "zero_optimization.stage",
                 "an integer from 0 to 3", "2.5");
}

TEST(DeepSpeedConfigNumbers, CountsOutsideTheirRangeAreRefused) {
  // 1e15 micro-batches per optimizer step: training never reached a step.
  expect_refused(R"({"gradient_accumulation_steps": 1e15})", "gradient_accumulation_steps",
                 "an integer from 1 to 1073741824", "1e+15");
  expect_refused(R"({"gradient_accumulation_steps": 0})", "gradient_accumulation_steps",
                 "an integer from 1 to 1073741824", "0");
  expect_refused(R"({"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": -5}}})",
                 "scheduler.params.warmup_num_steps", "an integer from 0 to 9007199254740992",
                 "-5");
  expect_refused(R"({"train_micro_batch_size_per_gpu": -1})", "train_micro_batch_size_per_gpu",
                 "an integer from 1 to 1073741824", "-1");
}

TEST(DeepSpeedConfigNumbers, RealNumbersMustBeFiniteAndInRange) {
  // A learning rate of 1e308 trained to a nan loss and exit 0.
  expect_refused(R"({"optimizer": {"type": "Adam", "params": {"lr": 1e308}}})",
                 "optimizer.params.lr", "a number above 0 and at most 1000", "1e+308");
  expect_refused(R"({"optimizer": {"type": "Adam", "params": {"lr": 0}}})",
                 "optimizer.params.lr", "a number above 0 and at most 1000", "0");
  expect_refused(R"({"optimizer": {"type": "Adam", "params": {"eps": -1e-8}}})",
                 "optimizer.params.eps", "a number above 0 and at most 1", "-1e-08");
  expect_refused(R"({"gradient_clipping": -1})", "gradient_clipping",
                 "a number from 0 to 1e+15", "-1");
  const std::string e =
      refusal(R"({"optimizer": {"type": "Adam", "params": {"betas": [0.9, 1.5]}}})");
  EXPECT_NE(e.find("'optimizer.params.betas' must be an array of two numbers from 0 to 1"),
            std::string::npos)
      << e;
}

TEST(DeepSpeedConfigNumbers, TextAfterANulByteIsRefused) {
  const auto path = std::filesystem::temp_directory_path() /
                    ("fsdp_ds_nul_" + std::to_string(::getpid()) + ".json");
  {
    std::ofstream f(path, std::ios::binary);
    const std::string text = std::string(R"({"zero_optimization": {"stage": 2}})") +
                             std::string(1, '\0') + "{\"stage\": 999, garbage";
    f << text;
  }
  const std::string e = refusal(path.string());
  std::filesystem::remove(path);
  EXPECT_NE(e.find("holds a NUL byte at offset 35"), std::string::npos) << e;
}

TEST(DeepSpeedConfigNumbers, ValuesInRangeAreAccepted) {
  fsdp::DeepSpeedTrainingConfig t;
  const fsdp::DeepSpeedOptions o = fsdp::parse_deepspeed_config(
      R"({"zero_optimization": {"stage": 3.0, "reduce_bucket_size": 2e8,
            "offload_param": {"device": "cpu", "buffer_size": 9007199254740992, "max_in_cpu": 0}},
          "aio": {"queue_depth": 4096, "block_size": 1073741824, "intra_op_parallelism": 64},
          "gradient_accumulation_steps": 1073741824,
          "optimizer": {"type": "AdamW", "params": {"lr": 1000, "betas": [0, 0.999]}},
          "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 0}}})",
      &t);
  EXPECT_EQ(o.stage, 3);
  EXPECT_EQ(o.reduce_bucket_size, 2e8);
  EXPECT_EQ(o.params_buffer_size, 9007199254740992.0);
  EXPECT_EQ(o.max_in_cpu, 0);
  EXPECT_EQ(o.aio.queue_depth, 4096);
  EXPECT_EQ(o.aio.intra_op_parallelism, 64);
  EXPECT_EQ(t.gradient_accumulation_steps.value_or(0), 1073741824);
  EXPECT_EQ(t.lr, 1000);
  EXPECT_EQ(t.warmup_num_steps, 0);
}

// The options themselves (the library's API, and the flags that set them): element counts kept
// as doubles are whole, finite and at most 2^53 before they become integers.
TEST(DeepSpeedConfigNumbers, OptionsElementCountsAreCheckedBeforeConversion) {
  for (double bad : {1.2e19, -1.0, 0.5, std::numeric_limits<double>::quiet_NaN()}) {
    fsdp::DeepSpeedOptions o;
    o.stage = 3;
    o.offload_parameters = true;
    o.offload_params_device = "nvme";
    o.offload_optimizer = true;
    o.offload_optimizer_device = "nvme";
    o.nvme_path = "/tmp";
    o.params_buffer_size = bad;
    const std::string e = error_of([&] { fsdp::DeepSpeedStrategy s(o); });
    EXPECT_NE(e.find("offload_param buffer_size must be a whole number of elements from 1 to "
                     "9007199254740992"),
              std::string::npos)
        << bad << ": " << e;
  }
  fsdp::DeepSpeedOptions o;
  o.sub_group_size = 1e300;
  const std::string e = error_of([&] { fsdp::DeepSpeedStrategy s(o); });
  EXPECT_NE(e.find("sub_group_size must be a whole number of elements"), std::string::npos) << e;
}

}  // namespace
