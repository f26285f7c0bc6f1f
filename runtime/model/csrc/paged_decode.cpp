// Decode attention on CPU straight from the paged KV cache: one query token per sequence,
// K/V read where they lie in their blocks (no gathered copy), float32 scores and softmax
// (bf16 x bf16 products, exact in float32, on the AVX-512 BF16 path).
// One task per (sequence, KV head): the query heads sharing that KV head are scored together,
// so each K/V row is loaded once for all of them. Runs on torch's intra-op thread pool.
// Caches in the model dtype, or dynamic INT8 (kv_cache.py: int8 values, one fp16 scale per
// token and KV head, x = q * scale): a token's scale factors out of q.k and of its share of
// the values, so the int8 rows are read as they are and each scale is applied once per token.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <atomic>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define QUANTPIPE_AVX512_BF16 1
#endif

namespace {

inline float to_float(const c10::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}
inline float to_float(const float x) { return x; }
inline float to_float(const int8_t x) { return static_cast<float>(x); }

#ifdef QUANTPIPE_AVX512_BF16
// bf16 caches with head_dim 64 on CPUs with AVX-512 BF16 (the common serving case). The
// plain loops below leave most of the time in one horizontal sum per (token, query head);
// here q.k runs as bf16 dot products with float32 accumulation (vdpbf16ps: the products are
// exact, the sums float32), 16 tokens at a time, and the 16 sums of a tile are reduced
// together in one transpose-add tree.

// Lane i of the result is the sum of the 16 lanes of a[i].
inline __m512 sum16(const __m512* a) {
  __m512 p[8], q[4], r[2];
  for (int j = 0; j < 8; ++j)  // per 128-bit lane: a[2j] partials at 0 and 2, a[2j+1] at 1 and 3
    p[j] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * j], a[2 * j + 1]), _mm512_unpackhi_ps(a[2 * j], a[2 * j + 1]));
  for (int j = 0; j < 4; ++j)  // per 128-bit lane: the partials of a[4j .. 4j+3], in order
    q[j] = _mm512_add_ps(_mm512_shuffle_ps(p[2 * j], p[2 * j + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(p[2 * j], p[2 * j + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  for (int j = 0; j < 2; ++j)  // add 128-bit lanes pairwise
    r[j] = _mm512_add_ps(_mm512_shuffle_f32x4(q[2 * j], q[2 * j + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(q[2 * j], q[2 * j + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(r[0], r[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(r[0], r[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

inline __m512bh load_bh(const c10::BFloat16* p) { return (__m512bh)_mm512_loadu_si512(p); }

inline __m512 bf16_to_f32(const c10::BFloat16* p) {  // 16 values
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}

// scores[g * ctx + t] = scale * q_g . k_t for the `group` query heads at q (64 values each).
void scores_bf16_64(const c10::BFloat16* q, const c10::BFloat16* k, const int64_t* slots, int64_t ctx,
                    int64_t group, int64_t kv_heads, int64_t h, float scale, float* scores) {
  const __m512 vscale = _mm512_set1_ps(scale);
  for (int64_t g = 0; g < group; ++g) {
    const __m512bh q0 = load_bh(q + g * 64), q1 = load_bh(q + g * 64 + 32);
    for (int64_t t0 = 0; t0 < ctx; t0 += 16) {
      const int64_t n = std::min<int64_t>(16, ctx - t0);
      __m512 acc[16];
      for (int64_t i = 0; i < 16; ++i) {
        if (i < n) {
          const c10::BFloat16* kr = k + (slots[t0 + i] * kv_heads + h) * 64;
          acc[i] = _mm512_dpbf16_ps(_mm512_dpbf16_ps(_mm512_setzero_ps(), q0, load_bh(kr)), q1, load_bh(kr + 32));
        } else {
          acc[i] = _mm512_setzero_ps();
        }
      }
      _mm512_mask_storeu_ps(scores + g * ctx + t0, static_cast<__mmask16>((1u << n) - 1),
                            _mm512_mul_ps(sum16(acc), vscale));
    }
  }
}

// 16 values widened to float32: bf16 (the model dtype) or int8 (a dynamic INT8 cache).
inline __m512 load16(const c10::BFloat16* p) { return bf16_to_f32(p); }
inline __m512 load16(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

// Dynamic INT8 caches with head_dim 64, tiled as scores_bf16_64: each token's fp16 scale is
// applied to its tile's sums.
// scores[g * ctx + t] = k_scale_t * qf_g . k_t, qf in float32 and already times the softmax scale.
void scores_int8_64(const float* qf, const int8_t* k, const at::Half* k_scale, const int64_t* slots, int64_t ctx,
                    int64_t group, int64_t kv_heads, int64_t h, float* scores) {
  for (int64_t g = 0; g < group; ++g) {
    __m512 qv[4];
    for (int j = 0; j < 4; ++j) qv[j] = _mm512_loadu_ps(qf + g * 64 + 16 * j);
    for (int64_t t0 = 0; t0 < ctx; t0 += 16) {
      const int64_t n = std::min<int64_t>(16, ctx - t0);
      __m512 acc[16];
      alignas(64) float ks[16];
      for (int64_t i = 0; i < 16; ++i) {
        if (i < n) {
          const int64_t at = slots[t0 + i] * kv_heads + h;
          const int8_t* kr = k + at * 64;
          __m512 a = _mm512_mul_ps(qv[0], load16(kr));
          for (int j = 1; j < 4; ++j) a = _mm512_fmadd_ps(qv[j], load16(kr + 16 * j), a);
          acc[i] = a;
          ks[i] = static_cast<float>(k_scale[at]);
        } else {
          acc[i] = _mm512_setzero_ps();
          ks[i] = 0.f;
        }
      }
      _mm512_mask_storeu_ps(scores + g * ctx + t0, static_cast<__mmask16>((1u << n) - 1),
                            _mm512_mul_ps(sum16(acc), _mm512_load_ps(ks)));
    }
  }
}

// acc[g * 64 + d] = sum_t p[g * ctx + t] * v_t[d] for GN query heads, float32; GN * 4
// accumulators stay in registers. S: bf16 values, or int8 ones whose fp16 scale per token
// (v_scale) is folded into that token's probability.
template <int GN, typename S>
void weighted_v_tile(const float* p, const S* v, const at::Half* v_scale, const int64_t* slots, int64_t ctx,
                     int64_t kv_heads, int64_t h, float* acc) {
  constexpr bool kScaled = std::is_same_v<S, int8_t>;
  __m512 a[GN][4];
  for (int i = 0; i < GN; ++i)
    for (int j = 0; j < 4; ++j) a[i][j] = _mm512_setzero_ps();
  for (int64_t t = 0; t < ctx; ++t) {
    const int64_t at = slots[t] * kv_heads + h;
    const S* vr = v + at * 64;
    float vs = 1.f;
    if constexpr (kScaled) vs = static_cast<float>(v_scale[at]);
    __m512 row[4];
    for (int j = 0; j < 4; ++j) row[j] = load16(vr + 16 * j);
    for (int i = 0; i < GN; ++i) {
      const __m512 pi = _mm512_set1_ps(kScaled ? p[i * ctx + t] * vs : p[i * ctx + t]);
      for (int j = 0; j < 4; ++j) a[i][j] = _mm512_fmadd_ps(pi, row[j], a[i][j]);
    }
  }
  for (int i = 0; i < GN; ++i)
    for (int j = 0; j < 4; ++j) _mm512_storeu_ps(acc + i * 64 + 16 * j, a[i][j]);
}

template <typename S>
void weighted_v_64(const float* p, const S* v, const at::Half* v_scale, const int64_t* slots, int64_t ctx,
                   int64_t group, int64_t kv_heads, int64_t h, float* acc) {
  for (int64_t g0 = 0; g0 < group; g0 += 4) {
    const float* pg = p + g0 * ctx;
    float* ag = acc + g0 * 64;
    switch (std::min<int64_t>(4, group - g0)) {
      case 1: weighted_v_tile<1>(pg, v, v_scale, slots, ctx, kv_heads, h, ag); break;
      case 2: weighted_v_tile<2>(pg, v, v_scale, slots, ctx, kv_heads, h, ag); break;
      case 3: weighted_v_tile<3>(pg, v, v_scale, slots, ctx, kv_heads, h, ag); break;
      default: weighted_v_tile<4>(pg, v, v_scale, slots, ctx, kv_heads, h, ag); break;
    }
  }
}
#endif

// kDim > 0: head_dim fixed at compile time (64, 128), so the inner loops unroll into whole
// vectors with no remainder handling; 0: any head_dim. S: the cache's values, T (the model
// dtype) or int8_t with per-token scales k_scale / v_scale [slots, KVH] (nullptr for T).
template <typename T, typename S, int64_t kDim>
void decode(const T* q, const S* k, const S* v, const at::Half* k_scale, const at::Half* v_scale,
            const int64_t* table, const int64_t* lens, T* out,
            int64_t batch, int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t max_blocks,
            int64_t block_size, int64_t num_slots, float scale) {
  const int64_t dim = kDim > 0 ? kDim : head_dim;
  constexpr bool kScaled = std::is_same_v<S, int8_t>;
#ifdef QUANTPIPE_AVX512_BF16
  constexpr bool kFast = std::is_same_v<T, c10::BFloat16> && std::is_same_v<S, T> && kDim == 64;
  constexpr bool kFastInt8 = kScaled && kDim == 64;  // any q dtype: q is widened to float32 first
#else
  constexpr bool kFast = false;
  constexpr bool kFastInt8 = false;
#endif
  const int64_t group = heads / kv_heads;
  // Bounds are checked where the indices are read anyway (not in extra passes per layer);
  // a bad sequence is skipped and reported once all tasks are done.
  const int64_t num_blocks = num_slots / block_size;
  std::atomic<bool> bad_len{false}, bad_block{false};
  at::parallel_for(0, batch * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(group * dim), scores, row(dim), acc(group * dim);
    std::vector<int64_t> slots;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / kv_heads, h = task % kv_heads, ctx = lens[b];
      if (ctx < 1 || ctx > max_blocks * block_size) {
        bad_len = true;
        continue;
      }
      if (!kFast)  // the fast path multiplies bf16 q as it is and scales the sums
        for (int64_t g = 0; g < group; ++g)
          for (int64_t d = 0; d < dim; ++d)
            qf[g * dim + d] = to_float(q[(b * heads + h * group + g) * dim + d]) * scale;
      scores.assign(group * ctx, 0.f);
      // Slots of the sequence's tokens, block by block (no division per token).
      slots.resize(ctx);
      bool in_cache = true;
      for (int64_t blk = 0, t = 0; t < ctx; ++blk) {
        const int64_t id = table[b * max_blocks + blk];
        in_cache = in_cache && id >= 0 && id < num_blocks;
        for (int64_t o = 0; o < block_size && t < ctx; ++o, ++t) slots[t] = id * block_size + o;
      }
      if (!in_cache) {
        bad_block = true;
        continue;
      }
      if constexpr (kFast) {
#ifdef QUANTPIPE_AVX512_BF16
        scores_bf16_64(q + (b * heads + h * group) * 64, k, slots.data(), ctx, group, kv_heads, h, scale,
                       scores.data());
#endif
      } else if constexpr (kFastInt8) {
#ifdef QUANTPIPE_AVX512_BF16
        scores_int8_64(qf.data(), k, k_scale, slots.data(), ctx, group, kv_heads, h, scores.data());
#endif
      } else {
        for (int64_t t = 0; t < ctx; ++t) {
          const S* kr = k + (slots[t] * kv_heads + h) * dim;
          for (int64_t d = 0; d < dim; ++d) row[d] = to_float(kr[d]);
          float ks = 1.f;
          if constexpr (kScaled) ks = static_cast<float>(k_scale[slots[t] * kv_heads + h]);
          for (int64_t g = 0; g < group; ++g) {
            const float* qg = qf.data() + g * dim;
            float s = 0.f;
            for (int64_t d = 0; d < dim; ++d) s += qg[d] * row[d];
            scores[g * ctx + t] = s * ks;
          }
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        float* sg = scores.data() + g * ctx;
        float m = sg[0], sum = 0.f;  // ctx >= 1: every decode attends to its own new token
        for (int64_t t = 1; t < ctx; ++t) m = std::max(m, sg[t]);
        for (int64_t t = 0; t < ctx; ++t) sg[t] = std::exp(sg[t] - m);
        for (int64_t t = 0; t < ctx; ++t) sum += sg[t];
        const float inv = 1.f / sum;
        for (int64_t t = 0; t < ctx; ++t) sg[t] *= inv;
      }
      if constexpr (kFast || kFastInt8) {
#ifdef QUANTPIPE_AVX512_BF16
        weighted_v_64(scores.data(), v, v_scale, slots.data(), ctx, group, kv_heads, h, acc.data());
#endif
      } else {
        std::fill(acc.begin(), acc.end(), 0.f);
        for (int64_t t = 0; t < ctx; ++t) {
          const S* vr = v + (slots[t] * kv_heads + h) * dim;
          for (int64_t d = 0; d < dim; ++d) row[d] = to_float(vr[d]);
          float vs = 1.f;
          if constexpr (kScaled) vs = static_cast<float>(v_scale[slots[t] * kv_heads + h]);
          for (int64_t g = 0; g < group; ++g) {
            const float p = scores[g * ctx + t] * vs;
            float* ag = acc.data() + g * dim;
            for (int64_t d = 0; d < dim; ++d) ag[d] += p * row[d];
          }
        }
      }
      for (int64_t g = 0; g < group; ++g)
        for (int64_t d = 0; d < dim; ++d)
          out[(b * heads + h * group + g) * dim + d] = static_cast<T>(acc[g * dim + d]);
    }
  });
  TORCH_CHECK(!bad_len, "context_lens must be in [1, block_table columns * block_size]");
  TORCH_CHECK(!bad_block, "block_table holds a block id outside the cache");
}

// Checks shared by both entry points; returns (table, lens) as contiguous int64.
std::pair<torch::Tensor, torch::Tensor> check_layout(const torch::Tensor& q, const torch::Tensor& k_cache,
                                                     const torch::Tensor& v_cache, const torch::Tensor& block_table,
                                                     const torch::Tensor& context_lens, int64_t block_size) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 3 && v_cache.sizes() == k_cache.sizes(),
              "q [B, H, D] and K/V caches [slots, KVH, D] expected");
  TORCH_CHECK(q.size(1) % k_cache.size(1) == 0 && q.size(2) == k_cache.size(2), "head counts or sizes differ");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "K/V caches must be contiguous");
  auto table = block_table.to(torch::kLong).contiguous();
  auto lens = context_lens.to(torch::kLong).contiguous();
  TORCH_CHECK(table.size(0) == q.size(0) && lens.size(0) == q.size(0), "one block table row and length per query");
  TORCH_CHECK(block_size >= 1 && k_cache.size(0) % block_size == 0, "block_size must divide the cache's slots");
  TORCH_CHECK(q.scalar_type() == torch::kBFloat16 || q.scalar_type() == torch::kFloat, "bfloat16 or float32 only");
  return {table, lens};
}

// Runs decode<T, S, dim> for q's dtype T and the head size (64 and 128 compiled apart).
template <typename S>
torch::Tensor run_decode(torch::Tensor q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                         const at::Half* k_scale, const at::Half* v_scale, const torch::Tensor& table,
                         const torch::Tensor& lens, int64_t block_size) {
  q = q.contiguous();
  auto out = torch::empty_like(q);
  const float scale = 1.f / std::sqrt(static_cast<float>(q.size(2)));
  auto run = [&](auto* tag, auto dim_tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    using V = std::conditional_t<std::is_same_v<S, int8_t>, int8_t, T>;
    decode<T, V, decltype(dim_tag)::value>(q.data_ptr<T>(), k_cache.data_ptr<V>(), v_cache.data_ptr<V>(), k_scale,
                                           v_scale, table.data_ptr<int64_t>(), lens.data_ptr<int64_t>(),
                                           out.data_ptr<T>(), q.size(0), q.size(1), k_cache.size(1), q.size(2),
                                           table.size(1), block_size, k_cache.size(0), scale);
  };
  auto by_dim = [&](auto* tag) {
    if (q.size(2) == 64) run(tag, std::integral_constant<int64_t, 64>{});
    else if (q.size(2) == 128) run(tag, std::integral_constant<int64_t, 128>{});
    else run(tag, std::integral_constant<int64_t, 0>{});
  };
  if (q.scalar_type() == torch::kBFloat16) by_dim(static_cast<c10::BFloat16*>(nullptr));
  else by_dim(static_cast<float*>(nullptr));
  return out;
}

torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                           torch::Tensor block_table, torch::Tensor context_lens, int64_t block_size) {
  auto [table, lens] = check_layout(q, k_cache, v_cache, block_table, context_lens, block_size);
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && q.scalar_type() == v_cache.scalar_type(),
              "q and the K/V caches must share a dtype");
  return run_decode<void>(q, k_cache, v_cache, nullptr, nullptr, table, lens, block_size);
}

// Dynamic INT8 caches: int8 values [slots, KVH, D] and fp16 scales [slots, KVH] for K and V.
torch::Tensor paged_decode_int8(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor k_scale,
                                torch::Tensor v_scale, torch::Tensor block_table, torch::Tensor context_lens,
                                int64_t block_size) {
  auto [table, lens] = check_layout(q, k_cache, v_cache, block_table, context_lens, block_size);
  TORCH_CHECK(k_cache.scalar_type() == torch::kChar && v_cache.scalar_type() == torch::kChar,
              "INT8 K/V caches must be int8");
  for (const auto* s : {&k_scale, &v_scale})
    TORCH_CHECK(s->scalar_type() == torch::kHalf && s->is_contiguous() && s->dim() == 2 &&
                    s->size(0) == k_cache.size(0) && s->size(1) == k_cache.size(1),
                "INT8 K/V scales must be contiguous float16 [slots, KVH]");
  return run_decode<int8_t>(q, k_cache, v_cache, k_scale.data_ptr<at::Half>(), v_scale.data_ptr<at::Half>(), table,
                            lens, block_size);
}

}  // namespace

// elementwise.cpp, int8_linear.cpp and packed_linear.cpp, built into the same module.
torch::Tensor rms_norm_bf16(const torch::Tensor& x, const torch::Tensor& weight, double eps);
torch::Tensor silu_mul_bf16(const torch::Tensor& gate_up);
torch::Tensor int8_linear_bf16(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& scale,
                               const c10::optional<torch::Tensor>& zero);
bool int8_linear_vectorized();
torch::Tensor packed_linear_f32(const torch::Tensor& x, const torch::Tensor& weight, int64_t bits,
                                const c10::optional<torch::Tensor>& scale, const c10::optional<torch::Tensor>& zero,
                                int64_t max_decode_rows, int64_t max_tile_rows);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, "decode attention over the paged KV cache",
        py::call_guard<py::gil_scoped_release>());
  m.def("paged_decode_int8", &paged_decode_int8, "decode attention over a dynamic INT8 paged KV cache",
        py::call_guard<py::gil_scoped_release>());
  m.def("rms_norm_bf16", &rms_norm_bf16, "RMSNorm of bf16 rows in one pass", py::call_guard<py::gil_scoped_release>());
  m.def("silu_mul_bf16", &silu_mul_bf16, "SiLU(gate) * up of bf16 rows in one pass",
        py::call_guard<py::gil_scoped_release>());
  m.def("int8_linear_bf16", &int8_linear_bf16, "bf16 rows times int8 weights (less a zero point) scaled per output channel",
        py::arg("x"), py::arg("weight"), py::arg("scale"), py::arg("zero") = py::none(),
        py::call_guard<py::gil_scoped_release>());
  m.def("int8_linear_vectorized", &int8_linear_vectorized, "whether int8_linear_bf16 was built with AVX-512");
  m.def("packed_linear_f32", &packed_linear_f32, "float32 rows times packed int8 or 4-bit weights",
        py::arg("x"), py::arg("weight"), py::arg("bits"), py::arg("scale") = py::none(), py::arg("zero") = py::none(),
        py::arg("max_decode_rows") = 16, py::arg("max_tile_rows") = 512, py::call_guard<py::gil_scoped_release>());
}
