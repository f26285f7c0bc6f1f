// A bf16 layer's element-wise ops in one pass each, on CPU: RMSNorm, and SiLU(gate) * up.
// torch runs each as five to seven separate ops, every one reading and writing the whole
// activation; at prefill sizes they took a third of the step (BENCHMARKS.md). The values
// are rounded to bf16 where the torch composition rounds them (llama.py), so outputs
// differ from it only where float32 sums in another order land on the other side of a
// bf16 rounding boundary.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

inline float bf16_to_float(uint16_t x) {
  uint32_t bits = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// Round to nearest even, as c10::BFloat16's conversion does (no NaNs reach here).
inline uint16_t float_to_bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  bits += 0x7FFF + ((bits >> 16) & 1);
  return static_cast<uint16_t>(bits >> 16);
}

void check_rows(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kBFloat16, name, ": a bf16 CPU tensor, got ",
              t.scalar_type(), " on ", t.device());
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, name, ": rows of contiguous values expected");
}

}  // namespace

// x [T, D] (rows may be strided), weight [D] -> weight * bf16(x * rsqrt(mean(x^2) + eps)).
torch::Tensor rms_norm_bf16(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
  check_rows(x, "rms_norm_bf16 x");
  const int64_t rows = x.size(0), d = x.size(1);
  TORCH_CHECK(weight.scalar_type() == at::kBFloat16 && weight.is_contiguous() && weight.numel() == d,
              "rms_norm_bf16: weight must be contiguous bf16 of size ", d);
  auto out = torch::empty({rows, d}, x.options());
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr());
  const auto* wp = reinterpret_cast<const uint16_t*>(weight.data_ptr());
  auto* op = reinterpret_cast<uint16_t*>(out.data_ptr());
  const int64_t xs = x.stride(0);
  const float epsf = static_cast<float>(eps);
  at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const uint16_t* row = xp + r * xs;
      uint16_t* o = op + r * d;
      float ss = 0.f;
      for (int64_t i = 0; i < d; ++i) {
        const float v = bf16_to_float(row[i]);
        ss += v * v;
      }
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(d) + epsf);
      for (int64_t i = 0; i < d; ++i) {
        const float y = bf16_to_float(float_to_bf16(bf16_to_float(row[i]) * inv));
        o[i] = float_to_bf16(bf16_to_float(wp[i]) * y);
      }
    }
  });
  return out;
}

// gate_up [T, 2I] (gate then up, as the fused gate_up_proj writes them) -> bf16(silu(gate)) * up, [T, I].
torch::Tensor silu_mul_bf16(const torch::Tensor& gate_up) {
  check_rows(gate_up, "silu_mul_bf16 gate_up");
  const int64_t rows = gate_up.size(0), n = gate_up.size(1) / 2;
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "silu_mul_bf16: gate_up has an odd width ", gate_up.size(1));
  auto out = torch::empty({rows, n}, gate_up.options());
  const auto* gp = reinterpret_cast<const uint16_t*>(gate_up.data_ptr());
  auto* op = reinterpret_cast<uint16_t*>(out.data_ptr());
  const int64_t gs = gate_up.stride(0);
  at::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const uint16_t* g = gp + r * gs;
      const uint16_t* u = g + n;
      uint16_t* o = op + r * n;
      for (int64_t i = 0; i < n; ++i) {
        const float a = bf16_to_float(g[i]);
        // exp's argument capped below float32's overflow: -ffast-math assumes no infinities, and
        // silu(a) for a < -88 is within a bf16 rounding of a / exp(88) anyway.
        const float s = bf16_to_float(float_to_bf16(a / (1.f + std::exp(std::fmin(-a, 88.f)))));
        o[i] = float_to_bf16(s * bf16_to_float(u[i]));
      }
    }
  });
  return out;
}
