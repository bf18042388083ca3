// Float32-weight matmul on the CPU for the few activation rows of a decode step, an XLA FFI handler (docs/kernels.md
// "Float weights"), and its bfloat16-weight sibling (`KiviJaxBMatmul`, below). Its contract is
// kivi_jax.weights.FloatMatrix.matmul_t's XLA path: y = x W for a projection W [C, R] (a stacked [layers, C, R] leaf
// read at the layer index, in place: XLA's dot would first copy the layer's slice out of the stack), or y = x T^T for
// a table T [R, C] (the tied output head).
//
// Work items are blocks of output units shared out on XLA's intra-op thread pool; an item runs every tile of
// activation rows over its block (gemm.h), the first tile reading the block's weights from memory, the others from
// cache, so each weight is read from memory once per call whatever the rows.

#include "gemm.h"

namespace {

constexpr int64_t AXPY_ITEM = AXPY_NV * W;       // output units a work item of a projection takes
constexpr int64_t DOT_ITEM = 64;                // ... of a table

struct FArgs {
  const float* w;    // the layer's matrix
  int64_t R;         // output units
  bool projection;   // W [C, R] (else a table [R, C])
  float* y;          // [N, R]
  int64_t items;
};

// y_i = x W_i (or x T_i^T) for every matrix i of the call (matrices sharing their input, e.g. q, k, v), their
// blocks of output units one pool of work items.
ffi::Error FMatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> layer,
                       ffi::RemainingArgs args, ffi::RemainingRets rets, ffi::Span<const int64_t> projection) {
  auto xd = x.dimensions();
  if (xd.size() != 2) return ffi::Error::InvalidArgument("fmatmul: x must be [N, C]");
  const size_t M = projection.size();
  if (M == 0 || args.size() != M || rets.size() != M)
    return ffi::Error::InvalidArgument("fmatmul: one operand and one result a matrix");
  const int64_t N = xd[0], C = xd[1], l = layer.typed_data()[0];
  std::vector<FArgs> mats(M);
  std::vector<int64_t> first(M + 1, 0);  // first work item of each matrix
  for (size_t i = 0; i < M; ++i) {
    auto w = args.get<ffi::Buffer<ffi::F32>>(i);
    auto y = rets.get<ffi::Buffer<ffi::F32>>(i);
    if (!w.has_value() || !y.has_value()) return ffi::Error::InvalidArgument("fmatmul: float32 buffers only");
    auto wd = w->dimensions();
    if (wd.size() != 3) return ffi::Error::InvalidArgument("fmatmul: a matrix must be [L, A, B]");
    FArgs& a = mats[i];
    a.projection = projection[i] != 0;
    const int64_t in = a.projection ? wd[1] : wd[2];
    a.R = a.projection ? wd[2] : wd[1];
    if (in != C) return ffi::Error::InvalidArgument("fmatmul: a matrix's input size differs from x's columns");
    if ((*y)->element_count() != (size_t)(N * a.R)) return ffi::Error::InvalidArgument("fmatmul: y must be [N, R]");
    const int64_t li = std::min<int64_t>(std::max<int64_t>(l, 0), wd[0] - 1);
    a.w = w->typed_data() + li * wd[1] * wd[2];
    a.y = (*y)->typed_data();
    const int64_t unit = a.projection ? AXPY_ITEM : DOT_ITEM;
    a.items = (a.R + unit - 1) / unit;
    first[i + 1] = first[i] + a.items;
  }
  const float* xp = x.typed_data();
  parallel_for(pool, first[M], [&](int64_t it) {
    size_t i = 0;
    while (it >= first[i + 1]) ++i;
    const FArgs& a = mats[i];
    const int64_t unit = a.projection ? AXPY_ITEM : DOT_ITEM;
    const int64_t r0 = (it - first[i]) * unit, r1 = std::min(a.R, r0 + unit);
    if (a.projection) {
      axpy_block(xp, N, C, a.w, a.y, a.R, r0, r1);
    } else {
      const int64_t next_rows = std::max<int64_t>(0, std::min(a.R, r1 + DOT_ITEM) - r1);
      dot_block(xp, N, C, a.w + r0 * C, C, a.y, a.R, r0, r1, a.w + r1 * C, next_rows * C * 4);
    }
  });
  return ffi::Error::Success();
}

// y_i = (x M_i^T) * scale_i for every bfloat16 matrix i of the call (`kivi_jax.weights` format bf16: its bits
// [L, R, C] uint16, a float32 scale [L, R, 1] a row), their blocks of DOT_ITEM rows one pool of work items. The
// weights are widened to float32 as they are loaded (half a float32 matrix's bytes from memory); x as given (the
// caller rounds it to bfloat16, as XLA's bfloat16 dot does).
ffi::Error BMatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> layer,
                       ffi::RemainingArgs args, ffi::RemainingRets rets) {
  auto xd = x.dimensions();
  if (xd.size() != 2) return ffi::Error::InvalidArgument("bmatmul: x must be [N, C]");
  const size_t M = rets.size();
  if (M == 0 || args.size() != 2 * M) return ffi::Error::InvalidArgument("bmatmul: bits and scale a matrix");
  const int64_t N = xd[0], C = xd[1], l = layer.typed_data()[0];
  struct BArgs {
    const uint16_t* w;  // the layer's [R, C]
    const float* scale;  // [R]
    int64_t R;
    float* y;
  };
  std::vector<BArgs> mats(M);
  std::vector<int64_t> first(M + 1, 0);
  for (size_t i = 0; i < M; ++i) {
    auto w = args.get<ffi::Buffer<ffi::U16>>(2 * i);
    auto sc = args.get<ffi::Buffer<ffi::F32>>(2 * i + 1);
    auto y = rets.get<ffi::Buffer<ffi::F32>>(i);
    if (!w.has_value() || !sc.has_value() || !y.has_value())
      return ffi::Error::InvalidArgument("bmatmul: uint16 bits, float32 scales and results");
    auto wd = w->dimensions();
    auto sd = sc->dimensions();
    if (wd.size() != 3 || wd[2] != C) return ffi::Error::InvalidArgument("bmatmul: bits must be [L, R, C]");
    if (sd.size() != 3 || sd[0] != wd[0] || sd[1] != wd[1] || sd[2] != 1)
      return ffi::Error::InvalidArgument("bmatmul: a scale must be [L, R, 1]");
    BArgs& a = mats[i];
    a.R = wd[1];
    if ((*y)->element_count() != (size_t)(N * a.R)) return ffi::Error::InvalidArgument("bmatmul: y must be [N, R]");
    const int64_t li = std::min<int64_t>(std::max<int64_t>(l, 0), wd[0] - 1);
    a.w = w->typed_data() + li * a.R * C;
    a.scale = sc->typed_data() + li * a.R;
    a.y = (*y)->typed_data();
    first[i + 1] = first[i] + (a.R + DOT_ITEM - 1) / DOT_ITEM;
  }
  const float* xp = x.typed_data();
  parallel_for(pool, first[M], [&](int64_t it) {
    size_t i = 0;
    while (it >= first[i + 1]) ++i;
    const BArgs& a = mats[i];
    const int64_t r0 = (it - first[i]) * DOT_ITEM, r1 = std::min(a.R, r0 + DOT_ITEM);
    const int64_t next_rows = std::max<int64_t>(0, std::min(a.R, r1 + DOT_ITEM) - r1);
    dot_block(xp, N, C, a.w + r0 * C, C, a.y, a.R, r0, r1, a.w + r1 * C, next_rows * C * 2);
    for (int64_t n = 0; n < N; ++n)
      for (int64_t r = r0; r < r1; ++r) a.y[n * a.R + r] *= a.scale[r];
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(KiviJaxBMatmul, BMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [N, C]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer []
                                  .RemainingArgs()               // per matrix: bits [L, R, C] uint16, scale [L, R, 1]
                                  .RemainingRets());             // per matrix: y [N, R] float32

XLA_FFI_DEFINE_HANDLER_SYMBOL(KiviJaxFMatmul, FMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [N, C]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer []
                                  .RemainingArgs()               // per matrix: [L, C, R] (a projection) or [L, R, C]
                                  .RemainingRets()               // per matrix: y [N, R] float32
                                  .Attr<ffi::Span<const int64_t>>("projection"));
