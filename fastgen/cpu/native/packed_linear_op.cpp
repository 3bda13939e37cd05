// `fastgen::packed_linear` for CPU tensors in C++, so a compiled graph's call goes from its C++
// wrapper through the dispatcher straight to the GEMM: no Python, no GIL, no argument objects.
//
// The op's schema and its Python kernel are `fastgen.cpu.native.packed_linear`'s; loading this
// library adds a kernel for the CPU dispatch key, which the dispatcher prefers to the Python one
// (registered for every backend). At 32 rows a product took about 10 us more through the Python
// kernel than the GEMM itself: a millisecond of every SmolLM2-135M decode step, 121 products.
//
// It knows the twins fastgen's GEMM packed (`fastgen_packed_linear_add_twin`, by the plain
// weight's address, with its shape and strides); any call it cannot serve exactly that way (no
// twin, a oneDNN twin, another dtype or shape, an empty weight, a strided input, a bias other
// than bf16 [N]) goes to the Python kernel, registered a second time as
// `fastgen::packed_linear_fallback`. Built against torch's stable C ABI only
// (torch/csrc/stable), so it compiles in about a second; where that fails the Python kernel runs.

#include <array>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <optional>
#include <unordered_map>
#include <vector>

#include <omp.h>

#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/tensor.h>

namespace {

using torch::stable::Tensor;

// fastgen_gemm of gemm.cpp (handed over by fastgen_packed_linear_set_gemm).
using GemmFn = int (*)(const uint16_t*, const uint16_t*, const float*, uint16_t*, int64_t, int64_t, int64_t, int);

struct Twin {
    const uint16_t* packed;
    int64_t n, k, stride0, stride1;
};

std::atomic<GemmFn> gemm{nullptr};
std::atomic<int64_t> served_count{0};
std::mutex twins_mutex;
std::unordered_map<const void*, Twin> twins;

bool lookup(const void* weight, Twin* out) {
    std::lock_guard<std::mutex> lock(twins_mutex);
    auto it = twins.find(weight);
    if (it == twins.end()) return false;
    *out = it->second;
    return true;
}

Tensor python_kernel(const Tensor& x, const Tensor& weight, const std::optional<Tensor>& bias) {
    std::array<StableIValue, 3> stack{torch::stable::detail::from(x), torch::stable::detail::from(weight),
                                      torch::stable::detail::from(bias)};
    TORCH_ERROR_CODE_CHECK(aoti_torch_call_dispatcher("fastgen::packed_linear_fallback", "", stack.data()));
    return torch::stable::detail::to<Tensor>(stack[0]);
}

Tensor packed_linear(Tensor x, Tensor weight, std::optional<Tensor> bias) {
    const int32_t bf16 = aoti_torch_dtype_bfloat16();
    int32_t x_dtype = 0, w_dtype = 0, b_dtype = 0;
    aoti_torch_get_dtype(x.get(), &x_dtype);
    aoti_torch_get_dtype(weight.get(), &w_dtype);
    if (bias.has_value()) aoti_torch_get_dtype(bias->get(), &b_dtype);
    Twin twin;
    const int64_t k = x.dim() > 0 ? x.size(-1) : -1;
    const GemmFn kernel = gemm.load();
    const bool served = kernel != nullptr && x_dtype == bf16 && w_dtype == bf16 && x.is_contiguous() &&
        weight.dim() == 2 && lookup(weight.data_ptr(), &twin) && weight.size(0) == twin.n &&
        weight.size(1) == twin.k && weight.stride(0) == twin.stride0 && weight.stride(1) == twin.stride1 &&
        k == twin.k && (!bias.has_value() || (b_dtype == bf16 && bias->dim() == 1 && bias->size(0) == twin.n &&
                                              bias->is_contiguous()));
    if (!served) return python_kernel(x, weight, bias);

    std::vector<int64_t> sizes(x.sizes().begin(), x.sizes().end());
    sizes.back() = twin.n;
    std::vector<int64_t> strides(sizes.size(), 1);
    for (int64_t d = int64_t(sizes.size()) - 2; d >= 0; --d) strides[d] = strides[d + 1] * sizes[d + 1];
    AtenTensorHandle handle = nullptr;
    TORCH_ERROR_CODE_CHECK(aoti_torch_empty_strided(int64_t(sizes.size()), sizes.data(), strides.data(), bf16,
                                                    aoti_torch_device_type_cpu(), 0, &handle));
    Tensor out(handle);
    const int64_t m = k > 0 ? x.numel() / k : 0;
    if (m == 0) return out;
    thread_local std::vector<float> bias32;  // the GEMM adds a float32 bias
    if (bias.has_value()) {
        const uint16_t* b = static_cast<const uint16_t*>(bias->data_ptr());
        bias32.resize(twin.n);
        for (int64_t i = 0; i < twin.n; ++i) {
            const uint32_t bits = uint32_t(b[i]) << 16;
            std::memcpy(&bias32[i], &bits, 4);
        }
    }
    served_count.fetch_add(1, std::memory_order_relaxed);
    // The thread count Inductor's own loops in the same graph use (torch sets it for OpenMP).
    kernel(static_cast<const uint16_t*>(x.data_ptr()), twin.packed, bias.has_value() ? bias32.data() : nullptr,
           static_cast<uint16_t*>(out.data_ptr()), m, twin.n, twin.k, omp_get_max_threads());
    return out;
}

}  // namespace

STABLE_TORCH_LIBRARY_IMPL(fastgen, CPU, m) { m.impl("packed_linear", TORCH_BOX(&packed_linear)); }

extern "C" {

int64_t fastgen_packed_linear_served() { return served_count.load(); }

void fastgen_packed_linear_set_gemm(void* fn) { gemm.store(reinterpret_cast<GemmFn>(fn)); }

// A twin of the bf16 weight at `weight` ([n, k] with these strides), packed by fastgen_gemm_pack.
// An empty weight gets none: F.linear (through the Python kernel) defines its product.
void fastgen_packed_linear_add_twin(const void* weight, const void* packed, int64_t n, int64_t k, int64_t stride0,
                                    int64_t stride1) {
    if (n <= 0 || k <= 0) return;
    std::lock_guard<std::mutex> lock(twins_mutex);
    twins[weight] = Twin{static_cast<const uint16_t*>(packed), n, k, stride0, stride1};
}

// Forget the twin at `weight`, if it is still the one packed into `packed`.
void fastgen_packed_linear_drop_twin(const void* weight, const void* packed) {
    std::lock_guard<std::mutex> lock(twins_mutex);
    auto it = twins.find(weight);
    if (it != twins.end() && it->second.packed == packed) twins.erase(it);
}

}  // extern "C"
