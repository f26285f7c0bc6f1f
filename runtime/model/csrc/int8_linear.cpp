// Weight-only int8 Linear for a few rows (decode) on CPU: y = (x @ (w - zero)^T) * scale, x and
// y bf16, w int8 [N, K] with one scale (and, for an asymmetric grid, one zero point) per output
// channel (W8A16 per channel).
//
// At one row the product is bound by reading the weights. torch's _weight_int8pack_mm read
// them at about 11 GB/s where the prepacked bf16 GEMM and the int4 kernel read theirs at
// 16-17 GB/s (30 layers' shapes of the default model, 2 threads, BENCHMARKS.md), so W8A16
// lost much of what halving the bytes should buy. Here each int8 weight row is widened to
// float32 in registers once and multiplied into every activation row: four weight rows
// stream side by side, the sums stay in float32 and are rounded to bf16 once, after the
// scale, as torch's kernel does. A zero point z enters as sum(x * w) - z * sum(x), both in
// float32 before that one rounding: the integer weights stream unchanged.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cstdint>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

#ifndef PREFETCH_BLOCKS
#define PREFETCH_BLOCKS 4
#endif

// ROWS activation rows (float32, [ROWS, K]) against weight rows n0..n0+3 (or fewer at the end).
template <int ROWS>
void block(const float* xf, int64_t k, const int8_t* w, const c10::BFloat16* scale, const float* zero,
           const float* xsum, int64_t n0, int64_t nw, c10::BFloat16* y, int64_t n_total) {
  float sums[ROWS][4] = {};
  int64_t i = 0;
#if defined(__AVX512F__)
  if (nw == 4) {
    __m512 acc[ROWS][4];
    for (int r = 0; r < ROWS; ++r)
      for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_setzero_ps();
    // The weight rows of a later block, a cache line per step: its 4 x K bytes are
    // contiguous, and the 64 bytes this step reads are one line's worth.
    const char* ahead = reinterpret_cast<const char*>(w + (n0 + 4 * PREFETCH_BLOCKS) * k);
    const char* end = reinterpret_cast<const char*>(w + n_total * k);
    for (; i + 16 <= k; i += 16) {
      if (ahead + 4 * i < end) _mm_prefetch(ahead + 4 * i, _MM_HINT_T0);
      __m512 wv[4];
      for (int j = 0; j < 4; ++j) {
        const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + (n0 + j) * k + i));
        wv[j] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b));
      }
      for (int r = 0; r < ROWS; ++r) {
        const __m512 xv = _mm512_loadu_ps(xf + r * k + i);
        for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_fmadd_ps(wv[j], xv, acc[r][j]);
      }
    }
    for (int r = 0; r < ROWS; ++r)
      for (int j = 0; j < 4; ++j) sums[r][j] = _mm512_reduce_add_ps(acc[r][j]);
  }
#endif
  for (int r = 0; r < ROWS; ++r)  // the tail of K (or everything without AVX-512)
    for (int64_t j = 0; j < nw; ++j)
      for (int64_t c = i; c < k; ++c) sums[r][j] += xf[r * k + c] * static_cast<float>(w[(n0 + j) * k + c]);
  if (zero != nullptr)
    for (int r = 0; r < ROWS; ++r)
      for (int64_t j = 0; j < nw; ++j) sums[r][j] -= zero[n0 + j] * xsum[r];
  for (int r = 0; r < ROWS; ++r)
    for (int64_t j = 0; j < nw; ++j)
      y[r * n_total + n0 + j] = c10::BFloat16(sums[r][j] * static_cast<float>(scale[n0 + j]));  // nearest even
}

template <int ROWS>
void rows_chunk(const float* xf, int64_t k, const int8_t* w, const c10::BFloat16* scale, const float* zero,
                const float* xsum, int64_t n, c10::BFloat16* y) {
  // 64 output channels a task: enough work per thread, and the weight rows of one task
  // (64 x K bytes) stay in L2 while the activation rows are reused against them.
  at::parallel_for(0, (n + 3) / 4, 16, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const int64_t n0 = b * 4;
      block<ROWS>(xf, k, w, scale, zero, xsum, n0, std::min<int64_t>(4, n - n0), y, n);
    }
  });
}

}  // namespace

// Whether this build has the AVX-512 path (the scalar loop is only a fallback for odd sizes).
bool int8_linear_vectorized() {
#if defined(__AVX512F__)
  return true;
#else
  return false;
#endif
}

// x [M, K] bf16 (rows contiguous), weight [N, K] int8 contiguous, scale [N] bf16, zero [N] float32
// or none -> y [M, N] bf16.
torch::Tensor int8_linear_bf16(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& scale,
                               const c10::optional<torch::Tensor>& zero) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kBFloat16 && x.dim() == 2,
              "int8_linear_bf16 x: a 2-d bf16 CPU tensor, got ", x.scalar_type(), " of ", x.dim(), " dims");
  TORCH_CHECK(weight.scalar_type() == at::kChar && weight.dim() == 2 && weight.is_contiguous(),
              "int8_linear_bf16 weight: a contiguous 2-d int8 tensor");
  const int64_t m = x.size(0), k = x.size(1), n = weight.size(0);
  TORCH_CHECK(weight.size(1) == k, "int8_linear_bf16: x has ", k, " columns, weight ", weight.size(1));
  TORCH_CHECK(scale.scalar_type() == at::kBFloat16 && scale.is_contiguous() && scale.numel() == n,
              "int8_linear_bf16 scale: contiguous bf16 of size ", n);
  const float* zp = nullptr;
  if (zero.has_value()) {
    TORCH_CHECK(zero->scalar_type() == at::kFloat && zero->is_contiguous() && zero->numel() == n,
                "int8_linear_bf16 zero: contiguous float32 of size ", n);
    zp = zero->data_ptr<float>();
  }
  const auto xc = x.contiguous();
  std::vector<float> xf(static_cast<size_t>(m * k));
  const auto* xp = xc.data_ptr<c10::BFloat16>();
  for (int64_t i = 0; i < m * k; ++i) xf[i] = static_cast<float>(xp[i]);
  std::vector<float> xsum(static_cast<size_t>(m), 0.0f);  // sum(x) per row: what a zero point multiplies
  if (zp != nullptr)
    for (int64_t r = 0; r < m; ++r)
      for (int64_t c = 0; c < k; ++c) xsum[r] += xf[r * k + c];
  auto y = torch::empty({m, n}, x.options());
  const auto* wp = weight.data_ptr<int8_t>();
  const auto* sp = scale.data_ptr<c10::BFloat16>();
  auto* yp = y.data_ptr<c10::BFloat16>();
  // Four activation rows at a time: 16 float32 accumulators, half the vector registers.
  int64_t r = 0;
  for (; r + 4 <= m; r += 4) rows_chunk<4>(xf.data() + r * k, k, wp, sp, zp, xsum.data() + r, n, yp + r * n);
  switch (m - r) {
    case 3: rows_chunk<3>(xf.data() + r * k, k, wp, sp, zp, xsum.data() + r, n, yp + r * n); break;
    case 2: rows_chunk<2>(xf.data() + r * k, k, wp, sp, zp, xsum.data() + r, n, yp + r * n); break;
    case 1: rows_chunk<1>(xf.data() + r * k, k, wp, sp, zp, xsum.data() + r, n, yp + r * n); break;
    default: break;
  }
  return y;
}
