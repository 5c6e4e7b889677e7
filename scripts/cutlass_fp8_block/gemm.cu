// CUTLASS's sm90 FP8 GEMM with blockwise scaling (cutlass::gemm::KernelTmaWarpSpecializedCooperativeFP8Blockwise),
// instantiated for miles-lp's two fp8_block GEMM forms and exported with a C ABI (raw device pointers, a stream), so
// that a device probe can load it with ctypes beside cuBLAS. Built on the development machine with nvcc for sm_90a
// (build.sh); CUTLASS is the nvidia-cutlass wheel's headers.
//
//   1d2d: D[M, N] (bf16, row-major) = A[M, K] (E4M3, K-major; scales [K/128, M], M fastest: 1x128 tiles)
//                                    x B[N, K] (E4M3, K-major; scales [N/128, K/128], K fastest: 128x128 tiles)
//   1d1d: the same with B's scales per row and 128-long K slice, [K/128, N], N fastest (the wgrad form)
#include <cuda_runtime.h>

#include "cutlass/cutlass.h"
#include "cute/tensor.hpp"
#include "cutlass/detail/blockwise_scale_layout.hpp"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/util/packed_stride.hpp"

using namespace cute;

template <int GranN, class Tile, class Cluster, class Schedule = cutlass::gemm::KernelTmaWarpSpecializedCooperativeFP8Blockwise,
          class EpiSchedule = cutlass::epilogue::TmaWarpSpecializedCooperative>
struct BlockGemm {
  using ElementA = cutlass::float_e4m3_t;
  using ElementB = cutlass::float_e4m3_t;
  using ElementD = cutlass::bfloat16_t;
  using LayoutA = cutlass::layout::RowMajor;
  using LayoutB = cutlass::layout::ColumnMajor;
  using LayoutD = cutlass::layout::RowMajor;
  static constexpr int AlignAB = 16;
  static constexpr int AlignD = 8;
  using ScaleConfig = cutlass::detail::Sm90BlockwiseScaleConfig<1, GranN, 128, cute::GMMA::Major::MN,
      (GranN == 1 ? cute::GMMA::Major::MN : cute::GMMA::Major::K)>;
  using LayoutSFA = decltype(ScaleConfig::deduce_layoutSFA());
  using LayoutSFB = decltype(ScaleConfig::deduce_layoutSFB());
  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Tile, Cluster,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float,
      void, LayoutD, AlignD, ElementD, LayoutD, AlignD,
      EpiSchedule>::CollectiveOp;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp,
      ElementA, cute::tuple<LayoutA, LayoutSFA>, AlignAB,
      ElementB, cute::tuple<LayoutB, LayoutSFB>, AlignAB,
      float, Tile, Cluster,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
      Schedule>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, Mainloop, Epilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;

  static typename Gemm::Arguments args(const void* a, const void* b, const float* sa, const float* sb, void* d,
                                       int m, int n, int k) {
    using StrideA = typename Kernel::StrideA;
    using StrideB = typename Kernel::StrideB;
    using StrideD = typename Kernel::StrideD;
    auto sA = cutlass::make_cute_packed_stride(StrideA{}, make_shape(m, k, 1));
    auto sB = cutlass::make_cute_packed_stride(StrideB{}, make_shape(n, k, 1));
    auto sD = cutlass::make_cute_packed_stride(StrideD{}, make_shape(m, n, 1));
    auto lSFA = ScaleConfig::tile_atom_to_shape_SFA(make_shape(m, n, k, 1));
    auto lSFB = ScaleConfig::tile_atom_to_shape_SFB(make_shape(m, n, k, 1));
    typename Gemm::Arguments arg{
        cutlass::gemm::GemmUniversalMode::kGemm,
        {m, n, k, 1},
        {static_cast<const ElementA*>(a), sA, static_cast<const ElementB*>(b), sB, sa, lSFA, sb, lSFB},
        {{}, nullptr, sD, static_cast<ElementD*>(d), sD}};
    arg.epilogue.thread.alpha = 1.0f;
    arg.epilogue.thread.beta = 0.0f;
    return arg;
  }

  static size_t workspace(int m, int n, int k) {
    return Gemm::get_workspace_size(args(nullptr, nullptr, nullptr, nullptr, nullptr, m, n, k));
  }

  static int run(const void* a, const void* b, const float* sa, const float* sb, void* d, int m, int n, int k,
                 void* ws, cudaStream_t stream) {
    Gemm gemm;
    auto arg = args(a, b, sa, sb, d, m, n, k);
    if (gemm.can_implement(arg) != cutlass::Status::kSuccess) return 1;
    if (gemm.initialize(arg, ws, stream) != cutlass::Status::kSuccess) return 2;
    if (gemm.run(stream) != cutlass::Status::kSuccess) return 3;
    return cudaGetLastError() == cudaSuccess ? 0 : 4;
  }
};

using G1d2d = BlockGemm<128, Shape<_128, _128, _128>, Shape<_1, _2, _1>>;
using G1d1d = BlockGemm<1, Shape<_128, _128, _128>, Shape<_1, _2, _1>>;
using Ping = cutlass::gemm::KernelTmaWarpSpecializedPingpongFP8Blockwise;
using PingEpi = cutlass::epilogue::TmaWarpSpecialized;
using G1d2dP = BlockGemm<128, Shape<_64, _128, _128>, Shape<_1, _2, _1>, Ping, PingEpi>;
using G1d1dP = BlockGemm<1, Shape<_64, _128, _128>, Shape<_1, _2, _1>, Ping, PingEpi>;
using G1d1dW = BlockGemm<1, Shape<_128, _256, _128>, Shape<_1, _1, _1>>;
using G1d1dC = BlockGemm<1, Shape<_128, _128, _128>, Shape<_2, _1, _1>>;

#define MLP_EXPORT(NAME, G)                                                                                          \
  size_t mlp_fp8_block_ws_##NAME(int m, int n, int k) { return G::workspace(m, n, k); }                              \
  int mlp_fp8_block_gemm_##NAME(const void* a, const void* b, const float* sa, const float* sb, void* d, int m,      \
                                int n, int k, void* ws, void* stream) {                                             \
    return G::run(a, b, sa, sb, d, m, n, k, ws, static_cast<cudaStream_t>(stream));                                 \
  }

// 1d2d / 1d1d: cooperative 128x128x128, cluster 1x2; P: pingpong 64x128x128; W: 1d1d 128x256 tiles; C: cluster 2x1
extern "C" {
MLP_EXPORT(1d2d, G1d2d)
MLP_EXPORT(1d1d, G1d1d)
MLP_EXPORT(1d2d_p, G1d2dP)
MLP_EXPORT(1d1d_p, G1d1dP)
MLP_EXPORT(1d1d_w, G1d1dW)
MLP_EXPORT(1d1d_c, G1d1dC)
}
