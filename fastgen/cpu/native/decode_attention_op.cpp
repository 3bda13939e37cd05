// `fastgen::paged_decode_attention_cpu` for CPU tensors in C++: the same kernel as the op's Python
// implementation (decode_attention.cpp, handed over by address with
// fastgen_decode_attention_op_set_entry), without the way through Python. A compiled decode step
// calls the op once a layer; through the Python implementation each call took about 16 us at
// SmolLM2-135M's shapes where the kernel itself took about 4 (the interpreter, its argument
// conversions and ctypes), which at batch 1 was a tenth of an int4 step.
//
// What it cannot serve (the kernel's library not handed over, int32 tables or lengths that are not
// contiguous, a dtype or head dim the kernel lacks) goes to the Python implementation, registered
// a second time as `fastgen::paged_decode_attention_cpu_reference`. Built against torch's stable
// C ABI only.

#include <array>
#include <atomic>
#include <cstdint>
#include <omp.h>

#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/tensor.h>

namespace {

using torch::stable::Tensor;

using EntryFn = int (*)(int, const void*, int64_t, int64_t, const void*, const void*, const int32_t*, int64_t,
                        const int32_t*, void*, int64_t, int64_t, int64_t, int64_t, int64_t, float, int);
std::atomic<EntryFn> entry{nullptr};
std::atomic<int64_t> served_count{0};

Tensor reference(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache, const Tensor& block_tables,
                 const Tensor& context_lens, double scale) {
    std::array<StableIValue, 6> stack{torch::stable::detail::from(q), torch::stable::detail::from(k_cache),
                                      torch::stable::detail::from(v_cache), torch::stable::detail::from(block_tables),
                                      torch::stable::detail::from(context_lens), torch::stable::detail::from(scale)};
    TORCH_ERROR_CODE_CHECK(aoti_torch_call_dispatcher("fastgen::paged_decode_attention_cpu_reference", "",
                                                      stack.data()));
    return torch::stable::detail::to<Tensor>(stack[0]);
}

Tensor paged_decode_attention_cpu(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor context_lens,
                                  double scale) {
    const EntryFn kernel = entry.load();
    int32_t q_dtype = 0, k_dtype = 0, v_dtype = 0, t_dtype = 0, l_dtype = 0;
    aoti_torch_get_dtype(q.get(), &q_dtype);
    aoti_torch_get_dtype(k_cache.get(), &k_dtype);
    aoti_torch_get_dtype(v_cache.get(), &v_dtype);
    aoti_torch_get_dtype(block_tables.get(), &t_dtype);
    aoti_torch_get_dtype(context_lens.get(), &l_dtype);
    const int32_t i32 = aoti_torch_dtype_int32();
    const int code = q_dtype == aoti_torch_dtype_float32() ? 0 : q_dtype == aoti_torch_dtype_bfloat16() ? 1 : -1;
    const bool served = kernel != nullptr && code >= 0 && q_dtype == k_dtype && q_dtype == v_dtype &&
        q.dim() == 3 && q.stride(2) == 1 && k_cache.dim() == 4 && k_cache.is_contiguous() &&
        v_cache.is_contiguous() && k_cache.size(3) == q.size(2) && v_cache.dim() == 4 &&
        v_cache.size(0) == k_cache.size(0) && v_cache.size(1) == k_cache.size(1) &&
        v_cache.size(2) == k_cache.size(2) && v_cache.size(3) == k_cache.size(3) && t_dtype == i32 && l_dtype == i32 && block_tables.dim() == 2 &&
        block_tables.stride(1) == 1 && context_lens.dim() == 1 && context_lens.is_contiguous() &&
        block_tables.size(0) == q.size(0) && context_lens.size(0) == q.size(0);
    if (!served) return reference(q, k_cache, v_cache, block_tables, context_lens, scale);

    const int64_t batch = q.size(0), heads = q.size(1), head_dim = q.size(2);
    const std::array<int64_t, 3> sizes{batch, heads, head_dim}, strides{heads * head_dim, head_dim, 1};
    AtenTensorHandle handle = nullptr;
    TORCH_ERROR_CODE_CHECK(aoti_torch_empty_strided(3, sizes.data(), strides.data(), q_dtype,
                                                    aoti_torch_device_type_cpu(), 0, &handle));
    Tensor out(handle);
    if (kernel(code, q.data_ptr(), q.stride(0), q.stride(1), k_cache.data_ptr(), v_cache.data_ptr(),
               static_cast<const int32_t*>(block_tables.data_ptr()), block_tables.stride(0),
               static_cast<const int32_t*>(context_lens.data_ptr()), out.data_ptr(), batch, heads, k_cache.size(2),
               head_dim, k_cache.size(1), float(scale), omp_get_max_threads()) != 0)
        return reference(q, k_cache, v_cache, block_tables, context_lens, scale);
    served_count.fetch_add(1, std::memory_order_relaxed);
    return out;
}

}  // namespace

STABLE_TORCH_LIBRARY_IMPL(fastgen, CPU, m) {
    m.impl("paged_decode_attention_cpu", TORCH_BOX(&paged_decode_attention_cpu));
}

extern "C" {

// The kernel: decode_attention.cpp's fastgen_paged_decode_attention (run on torch's threads,
// omp_get_max_threads, as the Python implementation passes torch.get_num_threads()).
void fastgen_decode_attention_op_set_entry(void* fn) { entry.store(reinterpret_cast<EntryFn>(fn)); }

int64_t fastgen_decode_attention_op_served() { return served_count.load(); }

}  // extern "C"
