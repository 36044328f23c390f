// The slimcomm operator library: every schema is defined here, once.
// Backends register kernels in csrc/cpu/*.cpp and csrc/cuda/*.cu.
#include <Python.h>
#include <torch/library.h>

#include <string>

#include "common.h"

#ifndef SLIMCOMM_VERSION
#define SLIMCOMM_VERSION "unknown"
#endif
#ifndef SLIMCOMM_TORCH_VERSION
#define SLIMCOMM_TORCH_VERSION "unknown"
#endif
#ifndef SLIMCOMM_CUDA_ARCHS
#define SLIMCOMM_CUDA_ARCHS ""
#endif

namespace slimcomm {
namespace {

// JSON with what this binary was built with; read by `python -m slimcomm.info`.
std::string build_info() {
  std::string s = "{\"version\": \"" SLIMCOMM_VERSION "\", \"torch\": \"" SLIMCOMM_TORCH_VERSION
                  "\", \"cpu\": true, ";
#ifdef SLIMCOMM_WITH_CUDA
  s += "\"cuda\": true, \"cuda_archs\": \"" SLIMCOMM_CUDA_ARCHS "\"}";
#else
  s += "\"cuda\": false, \"cuda_archs\": \"\"}";
#endif
  return s;
}

// Sets this thread's CUDA index-check mode ("env", "host" or "device"; see
// cuda_checks_override in common.h) and returns the previous one.
std::string set_cuda_checks(const std::string& mode) {
  const int prev = cuda_checks_override;
  if (mode == "env") {
    cuda_checks_override = -1;
  } else if (mode == "host") {
    cuda_checks_override = 0;
  } else if (mode == "device") {
    cuda_checks_override = 1;
  } else {
    TORCH_CHECK(false, "slimcomm._cuda_checks: argument 'mode' must be 'env', 'host' or 'device', got '",
                mode, "'");
  }
  return prev < 0 ? "env" : (prev == 0 ? "host" : "device");
}

#ifndef SLIMCOMM_WITH_CUDA
// Without compiled CUDA kernels, every op called on CUDA tensors says so.
void no_cuda_kernels(const c10::OperatorHandle& op, torch::jit::Stack*) {
  TORCH_CHECK(false, "slimcomm.", op.schema().name(),
              ": this slimcomm build has no CUDA kernels (built without CUDA); rebuild with a "
              "CUDA-enabled torch and CUDA_HOME set, or SLIMCOMM_FORCE_CUDA=1 -- see "
              "`python -m slimcomm.info`");
}
#endif

}  // namespace

TORCH_LIBRARY(slimcomm, m) {
  m.def("significance_topk(Tensor weight, Tensor grad, int k, str score=\"product\") -> (Tensor, Tensor)");
  m.def("significance_topk_segmented(Tensor weight, Tensor grad, int[] offsets, int[] ks, "
        "str score=\"product\") -> (Tensor, Tensor)");
  m.def("explore_sample(int n, Tensor exclude, int m, int seed, int offset) -> Tensor");
  m.def("explore_sample_segmented(int[] offsets, Tensor exclude, int[] exclude_offsets, int[] ms, "
        "int seed, int[] rng_offsets) -> Tensor");
  m.def("pack(Tensor src, Tensor indices) -> Tensor");
  m.def("unpack(Tensor(a!) dst, Tensor indices, Tensor values, bool accumulate=False) -> ()");
  m.def("gather_slices(Tensor weight, Tensor? rows, Tensor? cols) -> Tensor");
  m.def("scatter_slices(Tensor(a!) weight, Tensor? rows, Tensor? cols, Tensor block) -> ()");
  m.def("gather_slices_multi(Tensor[] weights, Tensor?[] rows, Tensor?[] cols) -> Tensor");
  m.def("scatter_slices_multi(Tensor(a!)[] weights, Tensor?[] rows, Tensor?[] cols, "
        "Tensor buffer) -> ()");
  // The fused Slim-DP step (slimcomm/compressor.py; contracts in slimcomm/ops.py).
  m.def("step_encode(Tensor buf, Tensor indices, Tensor offsets, int world_size, "
        "ScalarType wire_dtype, Tensor(a!)? acc=None, Tensor? residual=None, Tensor? scale=None, "
        "float error_decay=1.0, bool accumulate=True, float? clip=None) -> Tensor");
  m.def("step_commit(Tensor(a!) buf, Tensor indices, Tensor offsets, Tensor avg, "
        "Tensor(b!) counter, Tensor(c!)? G=None, Tensor(d!)? acc=None, Tensor? residual=None, "
        "Tensor? scale=None, bool keep_all_zero=False, bool return_old_g=False, "
        "Tensor? void_in=None, bool write_buf=True) -> (Tensor, Tensor)");
  m.def("sgd_apply_indexed(Tensor(a!)[] params, Tensor indices, Tensor offsets, Tensor avg, "
        "float lr, bool keep_all_zero=False) -> ()");
  m.def("step_commit_local(Tensor(a!) buf, Tensor all_indices, Tensor all_values, "
        "Tensor offsets, int world_size, Tensor(b!) counter, Tensor(c!)? acc=None, "
        "Tensor? residual=None, bool keep_all_zero=False, Tensor? void_in=None) -> Tensor");
  m.def("step_undo(Tensor void_flag, Tensor(a!)? residual=None, Tensor? spare=None, "
        "Tensor(b!)? G=None, Tensor? indices=None, Tensor? old_g=None, "
        "Tensor(c!)? counter=None) -> ()");
  // The low-bit value codec (slimcomm/compressor.py, value_bits; contracts in slimcomm/ops.py).
  m.def("quantize_chunks(Tensor vals, Tensor seg_offsets, int chunk, int bits, int nchunks) "
        "-> (Tensor, Tensor, Tensor)");
  m.def("dequantize_chunks_mean(Tensor packed, Tensor scales, Tensor seg_offsets, int chunk, "
        "int bits, int numel, float divisor) -> Tensor");
  m.def("_build_info() -> str", &build_info);
  m.def("_cuda_checks(str mode) -> str", &set_cuda_checks);
}

#ifndef SLIMCOMM_WITH_CUDA
TORCH_LIBRARY_IMPL(slimcomm, CUDA, m) {
  for (const char* name : {"significance_topk", "significance_topk_segmented", "explore_sample",
                           "explore_sample_segmented", "pack", "unpack", "gather_slices",
                           "scatter_slices", "gather_slices_multi", "scatter_slices_multi",
                           "step_encode", "step_commit", "step_commit_local", "step_undo",
                           "sgd_apply_indexed", "quantize_chunks", "dequantize_chunks_mean"}) {
    m.impl(name, torch::CppFunction::makeFromBoxedFunction<&no_cuda_kernels>());
  }
}
#endif

}  // namespace slimcomm

// A Python module with no functions: importing slimcomm._C loads this library,
// whose static initialisers register the ops above.
extern "C" PyObject* PyInit__C(void) {
  static struct PyModuleDef def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr,
                                   nullptr, nullptr, nullptr, nullptr};
  return PyModule_Create(&def);
}
