// The class templates of libtorch's headers that every file including <torch/torch.h> would
// instantiate again: see Note [libtorch's class templates, instantiated once] below.
//
// Note [libtorch's class templates, instantiated once]
// <torch/torch.h> declares objects whose constructors name the vtables of class templates:
// torch::nn::Cloneable<M> for every torch::nn module M, the optimizers' cloneable states,
// c10::SingleElementType<K, T>, torch::jit's attribute values, the MNIST dataset. A file that
// sees those vtables must define them, so clang instantiates every virtual function of these
// ~75 classes at the end of every translation unit, even an empty one: 3.5 s of each file's
// front end and more in its optimizer at -O3 (measured with -ftime-trace, clang 14, libtorch
// 2.13). The precompiled header (src/pch.h) therefore declares them `extern template class`
// (FSDP_TORCH_CLASS_TEMPLATES below), and src/common/torch_class_templates.cpp, in
// fsdp_runtime, defines them once. An empty file then compiles in 2.0 s instead of 5.1 s, and
// tests/test_trainer.cpp at -O3 in 18 s instead of 23 s.
//
// The list is the set an empty file instantiated with libtorch 2.13; every class here exists
// in libtorch 2.0 and later. A libtorch without one of them fails to compile src/pch.h: build
// with -DFSDP_TORCH_EXTERN_TEMPLATES=OFF (every file then instantiates them, as before) and
// remove the class from this list. Files that do not use the precompiled header (outside
// projects, the CPU Adam kernels, the fuzz targets) instantiate them themselves, as weak
// symbols that the linker merges with these.
#pragma once

// X(class-template-id) for each class; the ids contain commas, so X takes __VA_ARGS__.
#define FSDP_TORCH_CLASS_TEMPLATES(X) \
  X(c10::SingleElementType<c10::TypeKind::AwaitType, c10::AwaitType>) \
  X(c10::SingleElementType<c10::TypeKind::FutureType, c10::FutureType>) \
  X(c10::SingleElementType<c10::TypeKind::ListType, c10::ListType>) \
  X(c10::SingleElementType<c10::TypeKind::RRefType, c10::RRefType>) \
  X(torch::data::datasets::Dataset<torch::data::datasets::MNIST>) \
  X(torch::data::datasets::Dataset<torch::data::datasets::TensorDataset, torch::data::Example<at::Tensor, void>>) \
  X(torch::jit::ScalarAttributeValue<c10::complex<double>, torch::jit::AttributeKind::c>) \
  X(torch::jit::ScalarAttributeValue<double, torch::jit::AttributeKind::f>) \
  X(torch::jit::ScalarAttributeValue<std::basic_string<char>, torch::jit::AttributeKind::s>) \
  X(torch::jit::VectorAttributeValue<at::Tensor, torch::jit::AttributeKind::ts>) \
  X(torch::jit::VectorAttributeValue<c10::Type::SingletonOrSharedTypePtr<c10::Type>, torch::jit::AttributeKind::tys>) \
  X(torch::jit::VectorAttributeValue<c10::complex<double>, torch::jit::AttributeKind::cs>) \
  X(torch::jit::VectorAttributeValue<double, torch::jit::AttributeKind::fs>) \
  X(torch::jit::VectorAttributeValue<long, torch::jit::AttributeKind::is>) \
  X(torch::jit::VectorAttributeValue<std::basic_string<char>, torch::jit::AttributeKind::ss>) \
  X(torch::nn::Cloneable<torch::nn::AdaptiveLogSoftmaxWithLossImpl>) \
  X(torch::nn::Cloneable<torch::nn::BilinearImpl>) \
  X(torch::nn::Cloneable<torch::nn::Conv1dImpl>) \
  X(torch::nn::Cloneable<torch::nn::Conv2dImpl>) \
  X(torch::nn::Cloneable<torch::nn::Conv3dImpl>) \
  X(torch::nn::Cloneable<torch::nn::ConvTranspose1dImpl>) \
  X(torch::nn::Cloneable<torch::nn::ConvTranspose2dImpl>) \
  X(torch::nn::Cloneable<torch::nn::ConvTranspose3dImpl>) \
  X(torch::nn::Cloneable<torch::nn::CrossMapLRN2dImpl>) \
  X(torch::nn::Cloneable<torch::nn::EmbeddingBagImpl>) \
  X(torch::nn::Cloneable<torch::nn::EmbeddingImpl>) \
  X(torch::nn::Cloneable<torch::nn::FoldImpl>) \
  X(torch::nn::Cloneable<torch::nn::FractionalMaxPool2dImpl>) \
  X(torch::nn::Cloneable<torch::nn::FractionalMaxPool3dImpl>) \
  X(torch::nn::Cloneable<torch::nn::GRUCellImpl>) \
  X(torch::nn::Cloneable<torch::nn::GRUImpl>) \
  X(torch::nn::Cloneable<torch::nn::GroupNormImpl>) \
  X(torch::nn::Cloneable<torch::nn::LSTMCellImpl>) \
  X(torch::nn::Cloneable<torch::nn::LSTMImpl>) \
  X(torch::nn::Cloneable<torch::nn::LayerNormImpl>) \
  X(torch::nn::Cloneable<torch::nn::LinearImpl>) \
  X(torch::nn::Cloneable<torch::nn::LocalResponseNormImpl>) \
  X(torch::nn::Cloneable<torch::nn::LogSoftmaxImpl>) \
  X(torch::nn::Cloneable<torch::nn::ModuleDictImpl>) \
  X(torch::nn::Cloneable<torch::nn::MultiheadAttentionImpl>) \
  X(torch::nn::Cloneable<torch::nn::ParameterDictImpl>) \
  X(torch::nn::Cloneable<torch::nn::RNNCellImpl>) \
  X(torch::nn::Cloneable<torch::nn::RNNImpl>) \
  X(torch::nn::Cloneable<torch::nn::SequentialImpl>) \
  X(torch::nn::Cloneable<torch::nn::SoftmaxImpl>) \
  X(torch::nn::Cloneable<torch::nn::SoftminImpl>) \
  X(torch::nn::Cloneable<torch::nn::ThresholdImpl>) \
  X(torch::nn::Cloneable<torch::nn::TransformerDecoderImpl>) \
  X(torch::nn::Cloneable<torch::nn::TransformerDecoderLayerImpl>) \
  X(torch::nn::Cloneable<torch::nn::TransformerEncoderImpl>) \
  X(torch::nn::Cloneable<torch::nn::TransformerEncoderLayerImpl>) \
  X(torch::nn::Cloneable<torch::nn::UnflattenImpl>) \
  X(torch::nn::Cloneable<torch::nn::UnfoldImpl>) \
  X(torch::nn::ConvNdImpl<1, torch::nn::Conv1dImpl>) \
  X(torch::nn::ConvNdImpl<1, torch::nn::ConvTranspose1dImpl>) \
  X(torch::nn::ConvNdImpl<2, torch::nn::Conv2dImpl>) \
  X(torch::nn::ConvNdImpl<2, torch::nn::ConvTranspose2dImpl>) \
  X(torch::nn::ConvNdImpl<3, torch::nn::Conv3dImpl>) \
  X(torch::nn::ConvNdImpl<3, torch::nn::ConvTranspose3dImpl>) \
  X(torch::nn::ConvTransposeNdImpl<1, torch::nn::ConvTranspose1dImpl>) \
  X(torch::nn::ConvTransposeNdImpl<2, torch::nn::ConvTranspose2dImpl>) \
  X(torch::nn::ConvTransposeNdImpl<3, torch::nn::ConvTranspose3dImpl>) \
  X(torch::optim::OptimizerCloneableOptions<torch::optim::AdagradOptions>) \
  X(torch::optim::OptimizerCloneableOptions<torch::optim::AdamOptions>) \
  X(torch::optim::OptimizerCloneableOptions<torch::optim::AdamWOptions>) \
  X(torch::optim::OptimizerCloneableOptions<torch::optim::LBFGSOptions>) \
  X(torch::optim::OptimizerCloneableOptions<torch::optim::RMSpropOptions>) \
  X(torch::optim::OptimizerCloneableOptions<torch::optim::SGDOptions>) \
  X(torch::optim::OptimizerCloneableParamState<torch::optim::AdagradParamState>) \
  X(torch::optim::OptimizerCloneableParamState<torch::optim::AdamParamState>) \
  X(torch::optim::OptimizerCloneableParamState<torch::optim::AdamWParamState>) \
  X(torch::optim::OptimizerCloneableParamState<torch::optim::LBFGSParamState>) \
  X(torch::optim::OptimizerCloneableParamState<torch::optim::RMSpropParamState>) \
  X(torch::optim::OptimizerCloneableParamState<torch::optim::SGDParamState>)
