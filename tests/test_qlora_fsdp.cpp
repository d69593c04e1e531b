// FSDP over a quantized, frozen base with trainable LoRA (QLoRA): a tiny Llama loaded from an
// HF folder with NF4 + double quantization, prepare_for_kbit_training and adapters on every
// linear layer and the head, trained with FSDP FULL_SHARD (one unit per decoder layer, with
// activation checkpointing) at world 2 and 3 (real processes, Gloo and MPI) must match the
// single-process run: per-step losses and the gathered adapters within 1e-5 (fp32 compute,
// AdamW). Only adapters have gradients, reduce-scatters and optimizer state; the packed uint8
// weights are sharded like any other tensor in units that mix dtypes. With 8-bit AdamW and
// bf16 compute the runs agree within the quantization tolerance, and the loss falls.
// With the vocabulary as units of their own (an untied model's embedding table and head beside
// the layers, LlamaForCausalLM::is_unit; or a tied table as a unit, used twice per forward),
// QLoRA and full fine-tuning (every parameter trained) match the single-process runs too.
#include "fsdp/activation_checkpointing.h"
#include "fsdp/hf.h"
#include "fsdp/llama.h"
#include "fsdp/lora.h"
#include "fsdp/optim8bit.h"
#include "fsdp/quantization.h"
#include "fully_shard_common.h"
#include "hf_testing.h"
#include "shard/collectives.h"
#include "shard/fsdp_param_group.h"
#include "shard/fsdp_state.h"
#include "shard/fsdp_strategy_impl.h"

#include <gtest/gtest.h>
#include <torch/optim/adamw.h>

#include <set>

namespace {

using fsdp::testing::LoopConfig;

// A tiny Llama written by save_llama (vocab 256 >= the test batches' 64 tokens).
// tied: the head shares the embedding table (tie_word_embeddings).
std::string model_dir(bool tied = false) {
  const std::string dir =
      fsdp::testing::hf_scratch(tied ? "qlora_fsdp_model_tied" : "qlora_fsdp_model", /*keep=*/true);
  if (!fsdp::testing::in_child_rank()) {
    torch::manual_seed(123);
    fsdp::LlamaConfig c = fsdp::llama_preset("llama-tiny");
    c.num_hidden_layers = 3;
    c.tie_word_embeddings = tied;
    fsdp::LlamaForCausalLM m(c);
    fsdp::save_llama(m, dir, at::kBFloat16);  // bf16 on disk, as Llama checkpoints
  }
  return dir;
}

fsdp::LoraConfig lora_config() {
  fsdp::LoraConfig lora;
  lora.r = 4;
  lora.lora_alpha = 8;
  lora.target_modules = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                         "down_proj", "lm_head"};
  return lora;
}

// The adapters every run starts from: A Kaiming-uniform, B non-zero (PEFT starts B at zero;
// non-zero B gives A gradients from step 1), written once in PEFT's format. They must be full
// tensors set before FSDP shards a layer: inside configure_model under FSDP each layer is
// sharded as it is read (load_llama's layer hook), so lora_parameters() afterwards are this
// rank's dim-0 chunks, and drawing random values into those chunks gives each rank (and the
// single-process run) different adapters. Loading them with HfLoadOptions::adapter_dir puts
// them into each layer before it is sharded, as resuming a fine-tune from an adapter does.
std::string adapter_dir(const std::string& model) {
  const std::string dir = model + "/adapter";
  if (!fsdp::testing::in_child_rank()) {
    torch::manual_seed(77);
    fsdp::HfLoadOptions o;
    o.lora = lora_config();
    auto m = fsdp::load_llama(model, o);
    auto gen = at::make_generator<at::CPUGeneratorImpl>(5);
    at::NoGradGuard g;
    for (auto& [name, p] : fsdp::lora_parameters(*m)) {
      if (name.find("lora_B") != std::string::npos) p.copy_(at::randn(p.sizes(), gen) * 0.01);
    }
    fsdp::save_peft_adapter(*m, *o.lora, dir, model);
  }
  return dir;
}

struct QLoraLM : fsdp::LightningModule {
  std::string dir, adapter;
  at::ScalarType compute = at::kFloat;
  bool eight_bit = false;
  bool checkpointing = true;
  std::shared_ptr<fsdp::LlamaForCausalLM> model;

  void configure_model() override {
    if (model) return;
    fsdp::HfLoadOptions o;
    fsdp::QuantizationConfig q;
    q.compute_dtype = compute;
    o.quantization = q;
    o.prepare_for_kbit_training = true;
    o.adapter_dir = adapter;  // its config is lora_config()
    model = register_module("model", fsdp::load_llama(dir, o));
  }
  at::Tensor training_step(const fsdp::Batch& b, int64_t) override {
    at::Tensor logits = (*model)(b.input);
    return at::cross_entropy_loss(logits.reshape({-1, logits.size(-1)}), b.target.reshape({-1}));
  }
  fsdp::OptimizerConfig configure_optimizers() override {
    std::vector<at::Tensor> trainable;
    for (auto& p : parameters()) {
      if (p.requires_grad()) trainable.push_back(p);
    }
    if (eight_bit) {
      return {std::make_shared<fsdp::AdamW8bit>(trainable, fsdp::AdamW8bitOptions(5e-3).min_8bit_size(64))};
    }
    return {std::make_shared<torch::optim::AdamW>(trainable, torch::optim::AdamWOptions(5e-3).eps(1e-3))};
  }
};

// Which modules become units:
//   kLayers     the decoder layers (of_types(llama_layer_types()): the vocabulary in the root);
//   kIsUnit     LlamaForCausalLM::is_unit: the layers and, untied, the table and the head
//               (`*model` is read when the strategy sets up; before that the types decide);
//   kUnitTypes  of_types(llama_unit_types()): the layers and the table, tied or not.
enum class Units { kLayers, kIsUnit, kUnitTypes };

fsdp::AutoWrapPolicy wrap_policy(Units units, const std::shared_ptr<fsdp::LlamaForCausalLM>* model) {
  switch (units) {
    case Units::kLayers:
      return fsdp::AutoWrapPolicy::of_types(fsdp::llama_layer_types());
    case Units::kUnitTypes:
      return fsdp::AutoWrapPolicy::of_types(fsdp::llama_unit_types());
    case Units::kIsUnit:
      break;
  }
  return fsdp::AutoWrapPolicy::of_predicate([model](const torch::nn::Module& m, int64_t) {
    return fsdp::is_llama_unit(model->get(), m);
  });
}

// The names of the strategy's units other than the root, and the root's parameter count.
std::pair<std::set<std::string>, int64_t> unit_layout(fsdp::FSDPStrategy& strategy) {
  std::set<std::string> names;
  int64_t root_numel = 0;
  for (auto& unit : fsdp::detail::state_of(strategy).units()) {
    if (!unit->is_root()) {
      names.insert(unit->name());
      continue;
    }
    for (const auto& p : unit->params()) root_numel += p->unsharded().numel();
  }
  return {names, root_numel};
}

// The units other than the root (FQNs in the LightningModule) a policy should give.
std::set<std::string> unit_names(Units units, int layers, bool tied) {
  std::set<std::string> want;
  for (int i = 0; i < layers; ++i) want.insert("model.model.layers." + std::to_string(i));
  if (units == Units::kUnitTypes || (units == Units::kIsUnit && !tied)) {
    want.insert("model.model.embed_tokens");
  }
  if (units == Units::kIsUnit && !tied) want.insert("model.lm_head");
  return want;
}

// The adapters of the reference model by FQN.
std::map<std::string, at::Tensor> reference_adapters(QLoraLM& ref) {
  std::map<std::string, at::Tensor> out;
  for (auto& [k, v] : fsdp::lora_parameters(*ref.model)) out["model." + k] = v.detach();
  return out;
}

void check_parity(const std::string& dir, const std::string& adapter, int world_expected,
                  at::ScalarType compute, bool eight_bit,
                  double tol, Units units = Units::kLayers) {
  LoopConfig cfg;
  cfg.steps = 6;
  auto setup = [&](QLoraLM& m) {
    m.dir = dir;
    m.adapter = adapter;
    m.compute = compute;
    m.eight_bit = eight_bit;
  };
  QLoraLM ref;
  setup(ref);
  ref.configure_model();
  fsdp::apply_activation_checkpointing(*ref.model, fsdp::llama_layer_types());
  auto want = fsdp::testing::train_reference(ref, cfg);

  auto world = fsdp::world_group();
  ASSERT_EQ(world->size(), world_expected);
  QLoraLM lm;
  setup(lm);
  fsdp::FSDPOptions o;
  o.auto_wrap_policy = wrap_policy(units, &lm.model);
  o.activation_checkpointing_policy = fsdp::llama_layer_types();
  fsdp::FSDPStrategy strategy(o);
  fsdp::LaunchInfo launch;
  launch.rank = world->rank();
  launch.world_size = launch.local_world_size = world->size();
  strategy.connect(world, launch);
  auto got = fsdp::testing::train_with(strategy, lm, cfg);
  EXPECT_EQ(strategy.num_deferred_units(), 3);  // every layer sharded as it was read
  const auto [names, root_numel] = unit_layout(strategy);
  EXPECT_EQ(names, unit_names(units, 3, /*tied=*/false));
  if (units == Units::kIsUnit) EXPECT_EQ(root_numel, 64);  // the final norm alone
  fsdp::testing::expect_losses_close(got, want, tol);
  EXPECT_LT(got.back(), got.front());  // it learns

  // Gathered adapters equal the reference's.
  auto ref_adapters = reference_adapters(ref);
  auto gathered = fsdp::gather_lora_weights(*lm.model, world.get());
  ASSERT_EQ(gathered.size(), ref_adapters.size());
  for (auto& [name, t] : gathered) {
    const at::Tensor& r = ref_adapters.at("model." + name);
    ASSERT_EQ(t.sizes(), r.sizes()) << name;
    EXPECT_LE(fsdp::testing::max_abs_diff(t, r), tol * 10) << name;
  }

  // Only adapters: trainable parameters, gradients, reduce-scatter elements.
  int64_t uint8_params = 0, lora_shard_numel = 0;
  for (auto& p : lm.named_parameters()) {
    const bool lora = p.key().find(".lora_") != std::string::npos;
    EXPECT_EQ(p.value().requires_grad(), lora) << p.key();
    if (p.value().scalar_type() == at::kByte) ++uint8_params;
    if (lora) lora_shard_numel += p.value().numel();
  }
  EXPECT_EQ(uint8_params, 2 * 7 * 3);  // weight + quant_state of every quantized linear
  int64_t rs_numel = 0;
  for (auto& unit : fsdp::detail::state_of(strategy).units()) {
    rs_numel += unit->layout().reduce_scatter_numel;
  }
  EXPECT_EQ(rs_numel, lora_shard_numel);
  // The packed 4-bit weights are sharded: this rank holds about 1/world of them.
  for (auto& p : lm.named_parameters()) {
    if (p.key().find("layers.0.mlp.up_proj.base_layer.weight") != std::string::npos) {
      EXPECT_EQ(p.value().numel(), (64 * 128 / 2 + world_expected - 1) / world_expected);
    }
  }
}

void parity(int world, const std::string& backend) {
  const std::string dir = model_dir(), adapter = adapter_dir(dir);
  fsdp::testing::run_ranks(world, backend, [&](fsdp::ProcessGroup&) {
    check_parity(dir, adapter, world, at::kFloat, /*eight_bit=*/false, 1e-5);
  });
}

TEST(QLoraFsdp, MatchesSingleProcessWorld2) { parity(2, "gloo"); }

TEST(QLoraFsdp, MatchesSingleProcessWorld3) { parity(3, "gloo"); }

TEST(QLoraFsdp, MatchesSingleProcessWorld2Mpi) { parity(2, "mpi"); }

TEST(QLoraFsdp, MatchesSingleProcessWorld3Mpi) { parity(3, "mpi"); }

// merge_lora(strategy, model) / unmerge_lora(strategy, model) on the FSDP-sharded QLoRA model
// (NF4 base layers, the dense head with an adapter) give, gathered, exactly the parameters of
// the single-process merge_lora / unmerge_lora; the single-process version refuses the sharded
// model and names the FSDP one. See Note [Merging sharded adapters].
// bf16_params: FSDP computes with bf16 unsharded parameters (MixedPrecisionPolicy), the shards
// stay fp32; the merge works on the fp32 shards.
void check_merge(const std::string& dir, const std::string& adapter, int world_expected,
                 bool bf16_params = false, Units units = Units::kLayers) {
  QLoraLM ref;
  ref.dir = dir;
  ref.adapter = adapter;
  ref.configure_model();
  auto snapshot = [](torch::nn::Module& m) {
    std::map<std::string, at::Tensor> out;
    for (auto& p : m.named_parameters()) out[p.key()] = p.value().detach().clone();
    return out;
  };
  const auto ref_before = snapshot(ref);
  fsdp::merge_lora(*ref.model);
  const auto ref_merged = snapshot(ref);
  fsdp::unmerge_lora(*ref.model);
  const auto ref_unmerged = snapshot(ref);

  auto world = fsdp::world_group();
  ASSERT_EQ(world->size(), world_expected);
  QLoraLM lm;
  lm.dir = dir;
  lm.adapter = adapter;
  fsdp::FSDPOptions o;
  o.auto_wrap_policy = wrap_policy(units, &lm.model);
  if (bf16_params) {
    fsdp::MixedPrecisionPolicy mp;
    mp.param_dtype = at::kBFloat16;
    o.mixed_precision = mp;
  }
  auto owned = fsdp::testing::connect_to_world(std::make_shared<fsdp::FSDPStrategy>(o));
  fsdp::FSDPStrategy& strategy = *owned;
  fsdp::configure_model_with(strategy, lm);
  strategy.setup_module(lm);
  EXPECT_EQ(unit_layout(strategy).first,
            unit_names(units, 3, lm.model->config().tie_word_embeddings));
  try {
    fsdp::merge_lora(*lm.model);
    ADD_FAILURE() << "the single-process merge_lora accepted a sharded model";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("merge_lora(strategy, model)"), std::string::npos) << e.what();
  }
  auto& state = fsdp::detail::state_of(strategy);
  // Every parameter, gathered from its shards, against the reference's.
  auto expect_equal_to = [&](const std::map<std::string, at::Tensor>& want, const char* what) {
    int compared = 0, quantized_changed = 0;
    for (fsdp::detail::FsdpParam* p : state.all_params()) {
      const at::Tensor full = fsdp::detail::gather_full(*p, *state.shard_group());
      auto it = want.find(p->fqn());
      if (it == want.end()) {
        ADD_FAILURE() << what << ": no reference parameter '" << p->fqn() << "'";
        continue;
      }
      if (full.sizes() != it->second.sizes()) {
        ADD_FAILURE() << what << " " << p->fqn() << ": shape " << full.sizes() << " vs " << it->second.sizes();
        continue;
      }
      EXPECT_TRUE(at::equal(full, it->second)) << what << " " << p->fqn() << " max diff "
                                               << fsdp::testing::max_abs_diff(full.to(at::kFloat),
                                                                              it->second.to(at::kFloat));
      if (full.scalar_type() == at::kByte && !at::equal(full, ref_before.at(p->fqn()))) ++quantized_changed;
      ++compared;
    }
    EXPECT_EQ(compared, static_cast<int>(want.size())) << what;
    return quantized_changed;
  };
  fsdp::merge_lora(strategy, *lm.model);
  EXPECT_GT(expect_equal_to(ref_merged, "merged"), 0);  // the merge re-quantized the 4-bit layers
  fsdp::unmerge_lora(strategy, *lm.model);
  expect_equal_to(ref_unmerged, "unmerged");
  for (auto& m : lm.model->modules()) {
    if (auto* l = dynamic_cast<fsdp::LoraLinear*>(m.get())) EXPECT_FALSE(l->merged());
  }
}

void merge_parity(int world) {
  const std::string dir = model_dir(), adapter = adapter_dir(dir);
  fsdp::testing::run_ranks(world, "gloo", [&](fsdp::ProcessGroup&) { check_merge(dir, adapter, world); });
}

TEST(QLoraFsdp, MergeShardedEqualsSingleProcessWorld2) { merge_parity(2); }

TEST(QLoraFsdp, MergeShardedEqualsSingleProcessWorld3) { merge_parity(3); }

// The head tied to the embeddings and a LoRA target: the merge goes into the shared table (held
// by the root unit), under bf16 mixed precision.
TEST(QLoraFsdp, MergeShardedTiedHeadBf16ParamsWorld2) {
  const std::string dir = model_dir(/*tied=*/true), adapter = adapter_dir(dir);
  fsdp::testing::run_ranks(2, "gloo", [&](fsdp::ProcessGroup&) {
    QLoraLM probe;
    probe.dir = dir;
    probe.adapter = adapter;
    probe.configure_model();
    auto head = std::dynamic_pointer_cast<fsdp::LoraLinear>(probe.model->lm_head);
    ASSERT_TRUE(head);
    ASSERT_TRUE(std::dynamic_pointer_cast<fsdp::TiedLinear>(head->base_layer));
    check_merge(dir, adapter, 2, /*bf16_params=*/true);
  });
}

// The head tied to the embeddings, the table a unit of its own (of_types(llama_unit_types()),
// not the root's): the merge goes into the table's shards.
TEST(QLoraFsdp, MergeShardedTiedHeadTableAsUnitWorld3) {
  const std::string dir = model_dir(/*tied=*/true), adapter = adapter_dir(dir);
  fsdp::testing::run_ranks(3, "gloo", [&](fsdp::ProcessGroup&) {
    check_merge(dir, adapter, 3, /*bf16_params=*/false, Units::kUnitTypes);
  });
}

// The embedding table and the head (with its adapter) as units of their own (is_unit).
TEST(QLoraFsdp, VocabularyUnitsMatchSingleProcessWorld3) {
  const std::string dir = model_dir(), adapter = adapter_dir(dir);
  fsdp::testing::run_ranks(3, "gloo", [&](fsdp::ProcessGroup&) {
    check_parity(dir, adapter, 3, at::kFloat, /*eight_bit=*/false, 1e-5, Units::kIsUnit);
  });
}

TEST(QLoraFsdp, EightBitAdamWBf16ComputeWorld2) {
  const std::string dir = model_dir(), adapter = adapter_dir(dir);
  fsdp::testing::run_ranks(2, "gloo", [&](fsdp::ProcessGroup&) {
    // Blocks of the 8-bit states start at different elements on shards, and bf16 GEMMs may
    // round differently for fewer rows: agreement within a loose tolerance (measured: losses
    // 1.1e-5 relative, adapters 1.5e-3 absolute -- a third of one step's lr -- against the fp32
    // AdamW runs' 1.7e-7 and 7e-8).
    check_parity(dir, adapter, 2, at::kBFloat16, /*eight_bit=*/true, 2e-3);
  });
}

// Full fine-tuning of a random llama-tiny (every parameter trained, fp32, AdamW) with the
// vocabulary as units: the embedding's and the head's gradients are reduce-scattered like a
// layer's, and a tied table, called twice per forward, accumulates both uses' gradients before
// its one reduce-scatter.
struct LlamaLM : fsdp::LightningModule {
  bool tied = false;
  std::shared_ptr<fsdp::LlamaForCausalLM> model;

  void configure_model() override {
    if (model) return;
    torch::manual_seed(321);  // every rank and the reference build the same model
    fsdp::LlamaConfig c = fsdp::llama_preset("llama-tiny");
    c.num_hidden_layers = 3;
    c.tie_word_embeddings = tied;
    model = register_module("model", std::make_shared<fsdp::LlamaForCausalLM>(c));
  }
  at::Tensor training_step(const fsdp::Batch& b, int64_t) override {
    at::Tensor logits = (*model)(b.input);
    return at::cross_entropy_loss(logits.reshape({-1, logits.size(-1)}), b.target.reshape({-1}));
  }
  fsdp::OptimizerConfig configure_optimizers() override {
    // eps 1e-3: Adam divides by sqrt(v) + eps, so with the default 1e-8 a near-zero gradient
    // summed in another order (per rank, then reduced) moves its parameter by up to the lr.
    return {std::make_shared<torch::optim::AdamW>(parameters(), torch::optim::AdamWOptions(5e-3).eps(1e-3))};
  }
};

void full_finetune_parity(int world_expected, bool tied, Units units) {
  LoopConfig cfg;
  cfg.steps = 5;
  LlamaLM ref;
  ref.tied = tied;
  auto want = fsdp::testing::train_reference(ref, cfg);

  LlamaLM lm;
  lm.tied = tied;
  fsdp::FSDPOptions o;
  o.auto_wrap_policy = wrap_policy(units, &lm.model);
  auto owned = fsdp::testing::connect_to_world(std::make_shared<fsdp::FSDPStrategy>(o));
  ASSERT_EQ(owned->world_size(), world_expected);
  auto got = fsdp::testing::train_with(*owned, lm, cfg);
  fsdp::testing::expect_losses_close(got, want, 1e-5);
  EXPECT_LT(got.back(), got.front());  // it learns
  fsdp::testing::expect_params_close(owned->gather_full_params(), ref, 1e-5);
  const auto [names, root_numel] = unit_layout(*owned);
  EXPECT_EQ(names, unit_names(units, 3, tied));
  // The final norm alone, or beside the tied table.
  EXPECT_EQ(root_numel, tied && units == Units::kIsUnit ? 64 + 256 * 64 : 64);
  // This rank holds 1/world of the table (rows padded to a multiple of the world).
  int64_t table_shard = -1;
  for (auto& p : lm.named_parameters()) {
    if (p.key() == "model.model.embed_tokens.weight") table_shard = p.value().numel();
  }
  EXPECT_EQ(table_shard, (256 + world_expected - 1) / world_expected * 64);
}

TEST(LlamaFsdp, FullFinetuneVocabularyUnitsUntiedWorld2) {
  fsdp::testing::run_ranks(2, "gloo", [](fsdp::ProcessGroup&) {
    full_finetune_parity(2, /*tied=*/false, Units::kIsUnit);
  });
}

TEST(LlamaFsdp, FullFinetuneVocabularyUnitsUntiedWorld3Mpi) {
  fsdp::testing::run_ranks(3, "mpi", [](fsdp::ProcessGroup&) {
    full_finetune_parity(3, /*tied=*/false, Units::kIsUnit);
  });
}

// is_unit leaves a tied table in the root unit (Note [A tied table stays in the root]).
TEST(LlamaFsdp, FullFinetuneTiedTableInTheRootWorld2) {
  fsdp::testing::run_ranks(2, "gloo", [](fsdp::ProcessGroup&) {
    full_finetune_parity(2, /*tied=*/true, Units::kIsUnit);
  });
}

// The tied table as a unit, called twice per forward: both uses' gradients accumulate before
// its one reduce-scatter.
TEST(LlamaFsdp, FullFinetuneTiedTableAsUnitWorld3) {
  fsdp::testing::run_ranks(3, "gloo", [](fsdp::ProcessGroup&) {
    full_finetune_parity(3, /*tied=*/true, Units::kUnitTypes);
  });
}

TEST(LlamaFsdp, FullFinetuneTiedTableAsUnitWorld2Mpi) {
  fsdp::testing::run_ranks(2, "mpi", [](fsdp::ProcessGroup&) {
    full_finetune_parity(2, /*tied=*/true, Units::kUnitTypes);
  });
}

}  // namespace
