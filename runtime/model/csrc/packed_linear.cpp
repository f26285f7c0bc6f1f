// Weight-only quantized Linear for float32 activations on CPU, at any row count:
// y = x @ dequant(w)^T, with w held at its packed size (int8, or two 4-bit values a byte).
//
// torch's CPU int8 and int4 kernels are fast only with bf16 activations; a CPU without
// native bf16 (AVX2 only) serves float32, and a quantized model there used to hold its
// weights dequantized to float32: four times the bytes of int8, eight of int4, no faster
// than the float32 model. Here the weights stay packed and are widened where they are used:
//
// - Up to 16 rows (decode): four weight rows at a time are widened into an L1-sized
//   float32 tile and multiplied into every activation row while it is hot, with 4 x 2
//   independent vector sums. Each weight is read once, at its packed size; the weights
//   16 tiles ahead are prefetched (16 ran faster than 4 here and about even with 32).
// - Up to 512 rows: each thread widens tiles of output channels that fit its L2 and runs
//   a float32 GEMM (torch's) on each. Here this beat the float32 model's own GEMM at
//   16-512 rows (small-row GEMMs split over threads lose much of their speed).
// - More rows (prefill): the whole weight is widened into a buffer for the call, then one
//   GEMM on all threads; widening costs one pass over the weights against hundreds of
//   passes of multiply-adds. Here at 1,024 rows this ran 5% behind the float32 model's
//   time and the tiles 10%; at 512 the tiles were 4-5% ahead of it, this 2-3% behind.
// benchmarks/bench_packed_f32.py measures each path; BENCHMARKS.md has the figures.
//
// Dequantization: w[n, k] = (u - z[n, g]) * s[n, g], g = k / group_size, where u is the
// stored integer (int8 as is; 4-bit unsigned, see widen_row) and z the zero point,
// both exact in float32. Without scales the integer values themselves are multiplied
// (W8A8: the caller scales the product per token and per channel).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#define VW_ENABLED 1
#else
#define VW_ENABLED 0
#endif

namespace {

constexpr int64_t TILE_ROWS = 4;            // weight rows widened at a time on the decode path
constexpr int64_t PREFETCH_TILES = 16;      // how far ahead the decode path prefetches weights
constexpr int64_t L2_TILE_BYTES = 384 << 10;  // float32 tile of the tiles path: within a 512 KB+ L2
constexpr int64_t MAX_WIDENED_BYTES = 64 << 20;  // larger weights take the tiles path at every row count

struct Packed {
  const uint8_t* data;  // [N, row_bytes]
  int64_t row_bytes;
  int bits;             // 8: int8 values; 4: unsigned nibbles (widen_row)
  const float* scale;   // [N, G] or null
  const float* zero;    // [N, G] or null
  int64_t groups;       // G
  int64_t group_size;   // K / G
};

// Vectors of VW floats: AVX-512 or AVX2 + FMA registers under -march=native, else scalars.
#if defined(__AVX512F__)
constexpr int VW = 16;
using vec = __m512;
inline vec vzero() { return _mm512_setzero_ps(); }
inline vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, vec v) { _mm512_storeu_ps(p, v); }
inline vec vfma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
inline float vsum(vec v) { return _mm512_reduce_add_ps(v); }
inline vec widen_s8(const int8_t* p) {  // 16 int8 -> 16 floats
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline vec widen_u8(__m128i b) { return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(b)); }  // 16 bytes
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int VW = 8;
using vec = __m256;
inline vec vzero() { return _mm256_setzero_ps(); }
inline vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, vec v) { _mm256_storeu_ps(p, v); }
inline vec vfma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
inline float vsum(vec v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_hadd_ps(s, s);
  return _mm_cvtss_f32(_mm_hadd_ps(s, s));
}
inline vec widen_s8(const int8_t* p) {  // 8 int8 -> 8 floats
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline vec widen_u8(__m128i b) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b)); }  // low 8 bytes
#else
constexpr int VW = 0;  // no vector path: plain loops
#endif

// Widen weight row n into out[0..k) as float32. 4-bit rows hold 32 values per 16 bytes:
// byte i of a chunk carries value i in its low nibble and value 16 + i in its high one,
// so both halves widen with plain vector loads and stores.
inline void widen_row(const Packed& w, int64_t n, int64_t k, float* __restrict out) {
  const uint8_t* __restrict src = w.data + n * w.row_bytes;
  if (w.bits == 8) {
    const int8_t* s = reinterpret_cast<const int8_t*>(src);
    int64_t c = 0;
#if VW_ENABLED
    for (; c + VW <= k; c += VW) vstore(out + c, widen_s8(s + c));
#endif
    for (; c < k; ++c) out[c] = static_cast<float>(s[c]);
  } else {
    for (int64_t c0 = 0; c0 < k; c0 += 32) {
      const uint8_t* b = src + c0 / 2;
      float* o = out + c0;
#if VW_ENABLED
      const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b));
      const __m128i mask = _mm_set1_epi8(15);
      const __m128i lo = _mm_and_si128(bytes, mask), hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), mask);
      if constexpr (VW == 16) {
        vstore(o, widen_u8(lo));
        vstore(o + 16, widen_u8(hi));
      } else {
        vstore(o, widen_u8(lo));
        vstore(o + 8, widen_u8(_mm_srli_si128(lo, 8)));
        vstore(o + 16, widen_u8(hi));
        vstore(o + 24, widen_u8(_mm_srli_si128(hi, 8)));
      }
#else
      for (int i = 0; i < 16; ++i) o[i] = static_cast<float>(b[i] & 15);
      for (int i = 0; i < 16; ++i) o[16 + i] = static_cast<float>(b[i] >> 4);
#endif
    }
  }
  if (w.scale == nullptr) return;
  const float* s = w.scale + n * w.groups;
  const float* z = w.zero ? w.zero + n * w.groups : nullptr;
  for (int64_t g = 0; g < w.groups; ++g) {
    float* __restrict o = out + g * w.group_size;
    const float sg = s[g], zg = z ? z[g] : 0.0f;
    for (int64_t c = 0; c < w.group_size; ++c) o[c] = (o[c] - zg) * sg;
  }
}

// ROWS activation rows against the TILE_ROWS widened weight rows of `tile`: TILE_ROWS x
// ROWS independent vector sums, so the multiply-adds do not wait on each other.
template <int ROWS>
inline void dot_tile(const float* x, int64_t k, const float* tile, float out[][TILE_ROWS]) {
  int64_t c = 0;
#if VW_ENABLED
  vec acc[ROWS][TILE_ROWS];
  for (int r = 0; r < ROWS; ++r)
    for (int j = 0; j < TILE_ROWS; ++j) acc[r][j] = vzero();
  for (; c + VW <= k; c += VW) {
    vec wv[TILE_ROWS];
    for (int j = 0; j < TILE_ROWS; ++j) wv[j] = vload(tile + j * k + c);
    for (int r = 0; r < ROWS; ++r) {
      const vec xv = vload(x + r * k + c);
      for (int j = 0; j < TILE_ROWS; ++j) acc[r][j] = vfma(xv, wv[j], acc[r][j]);
    }
  }
  for (int r = 0; r < ROWS; ++r)
    for (int j = 0; j < TILE_ROWS; ++j) out[r][j] = vsum(acc[r][j]);
#else
  for (int r = 0; r < ROWS; ++r)
    for (int j = 0; j < TILE_ROWS; ++j) out[r][j] = 0.0f;
#endif
  for (; c < k; ++c)
    for (int r = 0; r < ROWS; ++r)
      for (int j = 0; j < TILE_ROWS; ++j) out[r][j] += x[r * k + c] * tile[j * k + c];
}

// Decode path: y[r, n0..n0+nw) for every row r of x, from weight rows n0..n0+nw (nw <= 4).
void small_tile(const float* x, int64_t m, int64_t k, const Packed& w, int64_t n0, int64_t nw, int64_t n,
                float* tile, float* y) {
  for (int64_t j = 0; j < nw; ++j) widen_row(w, n0 + j, k, tile + j * k);
  for (int64_t j = nw; j < TILE_ROWS; ++j) std::fill(tile + j * k, tile + (j + 1) * k, 0.0f);
  float out[2][TILE_ROWS];
  int64_t r = 0;
  for (; r + 2 <= m; r += 2) {
    dot_tile<2>(x + r * k, k, tile, out);
    for (int64_t j = 0; j < nw; ++j) y[r * n + n0 + j] = out[0][j], y[(r + 1) * n + n0 + j] = out[1][j];
  }
  if (r < m) {
    dot_tile<1>(x + r * k, k, tile, out);
    for (int64_t j = 0; j < nw; ++j) y[r * n + n0 + j] = out[0][j];
  }
}

// A float32 tile of at least `count` values, one per thread, kept between calls (the
// decode path's 4 weight rows, the tiles path's L2_TILE_BYTES).
float* tile_buffer(int64_t count) {
  thread_local std::vector<float> buffer;
  if (static_cast<int64_t>(buffer.size()) < count) buffer.resize(static_cast<size_t>(count));
  return buffer.data();
}

void decode_path(const float* x, int64_t m, int64_t k, const Packed& w, int64_t n, float* y) {
  const int64_t tiles = (n + TILE_ROWS - 1) / TILE_ROWS;
  at::parallel_for(0, tiles, 16, [&](int64_t begin, int64_t end) {
    float* tile = tile_buffer(TILE_ROWS * k);
    const char* last = reinterpret_cast<const char*>(w.data + n * w.row_bytes);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n0 = t * TILE_ROWS;
      // The weight bytes of a later tile: TILE_ROWS contiguous rows.
      const char* ahead = reinterpret_cast<const char*>(w.data + (n0 + TILE_ROWS * PREFETCH_TILES) * w.row_bytes);
      for (int64_t b = 0; b < TILE_ROWS * w.row_bytes && ahead + b < last; b += 64) __builtin_prefetch(ahead + b);
      small_tile(x, m, k, w, n0, std::min<int64_t>(TILE_ROWS, n - n0), n, tile, y);
    }
  });
}

// Middle path: tiles of output channels that fit L2_TILE_BYTES, the same count for every
// thread and a multiple of 16 channels each (the BLAS kernels' register blocking); each
// thread widens its tile and runs its GEMM on it while the tile is in its cache.
void tiles_path(const torch::Tensor& x, const Packed& w, int64_t n, torch::Tensor& y) {
  const int64_t k = x.size(1), threads = at::get_num_threads();
  const int64_t max_rows = std::max<int64_t>(16, L2_TILE_BYTES / (k * 4));
  int64_t tiles = (n + max_rows - 1) / max_rows;
  tiles = (tiles + threads - 1) / threads * threads;
  const int64_t rows = ((n + tiles - 1) / tiles + 15) / 16 * 16;
  tiles = (n + rows - 1) / rows;
  // The pool's threads do not inherit the caller's inference mode, and y is an inference
  // tensor when the caller runs in one: each thread takes the caller's mode.
  const bool inference = c10::InferenceMode::is_enabled();
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    c10::InferenceMode mode(inference);
    float* tp = tile_buffer(rows * k);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n0 = t * rows, nb = std::min(rows, n - n0);
      for (int64_t j = 0; j < nb; ++j) widen_row(w, n0 + j, k, tp + j * k);
      auto out = y.narrow(1, n0, nb);
      at::mm_out(out, x, torch::from_blob(tp, {nb, k}, x.options()).t());
    }
  });
}

// Prefill path: the whole weight widened into a buffer that lives for this call (weights
// over MAX_WIDENED_BYTES take the tiles path instead), then one GEMM on every thread.
void prefill_path(const torch::Tensor& x, const Packed& w, int64_t n, torch::Tensor& y) {
  const int64_t k = x.size(1);
  auto full = torch::empty({n, k}, x.options());
  float* fp = full.data_ptr<float>();
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; ++j) widen_row(w, j, k, fp + j * k);
  });
  at::mm_out(y, x, full.t());
}

}  // namespace

// x [M, K] float32; weight int8 [N, K] (bits 8) or uint8 [N, K / 2] (bits 4); scale and
// zero float32 [N, G] (zero may be undefined; without scale the integer values are used)
// -> y [M, N] float32. Up to `max_decode_rows` rows take the decode path, up to
// `max_tile_rows` the tiles path, more the prefill path.
torch::Tensor packed_linear_f32(const torch::Tensor& x, const torch::Tensor& weight, int64_t bits,
                                const c10::optional<torch::Tensor>& scale, const c10::optional<torch::Tensor>& zero,
                                int64_t max_decode_rows, int64_t max_tile_rows) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2,
              "packed_linear_f32 x: a 2-d float32 CPU tensor, got ", x.scalar_type(), " of ", x.dim(), " dims");
  TORCH_CHECK(bits == 8 || bits == 4, "packed_linear_f32: bits must be 8 or 4, got ", bits);
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous() && weight.element_size() == 1,
              "packed_linear_f32 weight: a contiguous 2-d int8/uint8 tensor");
  const int64_t m = x.size(0), k = x.size(1), n = weight.size(0);
  TORCH_CHECK(weight.size(1) * (bits == 4 ? 2 : 1) == k, "packed_linear_f32: x has ", k,
              " columns, the ", bits, "-bit weight holds ", weight.size(1) * (bits == 4 ? 2 : 1));
  TORCH_CHECK(k % 32 == 0, "packed_linear_f32: the input size must be a multiple of 32, got ", k);
  Packed w{static_cast<const uint8_t*>(weight.data_ptr()), weight.size(1), static_cast<int>(bits),
           nullptr, nullptr, 1, k};
  if (scale.has_value() && scale->defined()) {
    TORCH_CHECK(scale->scalar_type() == at::kFloat && scale->is_contiguous() && scale->dim() == 2 &&
                scale->size(0) == n && k % scale->size(1) == 0,
                "packed_linear_f32 scale: contiguous float32 [", n, ", G] with G dividing ", k);
    w.scale = scale->data_ptr<float>();
    w.groups = scale->size(1);
    w.group_size = k / w.groups;
    if (zero.has_value() && zero->defined()) {
      TORCH_CHECK(zero->sizes() == scale->sizes() && zero->scalar_type() == at::kFloat && zero->is_contiguous(),
                  "packed_linear_f32 zero: contiguous float32 of the scale's shape");
      w.zero = zero->data_ptr<float>();
    }
  }
  const auto xc = x.contiguous();
  auto y = torch::empty({m, n}, x.options());
  if (m <= max_decode_rows) {
    decode_path(xc.data_ptr<float>(), m, k, w, n, y.data_ptr<float>());
  } else if (m <= max_tile_rows || n * k * 4 > MAX_WIDENED_BYTES) {
    tiles_path(xc, w, n, y);
  } else {
    prefill_path(xc, w, n, y);
  }
  return y;
}
