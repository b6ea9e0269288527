// The meta kernels ckptune registers (`meta_kernels.cpp`, `meta_conv.cpp`).
#pragma once

#include <torch/library.h>

#include <string>
#include <utility>

namespace ckpt {

// Whether ckptune registered the meta kernel of `name` (`aten::mkldnn_convolution`, with
// `.overload` if it has one). Those are written for fake tensors: fake mode hands them the fake
// tensors themselves, which report the CPU, so that what they ask of libtorch (a convolution
// backend, a memory format) is what the CPU would answer.
bool own_meta_kernel(const std::string& name);

// Records a registration (done by the files that register them).
void note_own_meta_kernel(const std::string& name);

// Registers `fn` as the meta kernel of `aten::name` and records it as ckptune's.
template <typename Fn>
void register_own(torch::Library& m, const char* name, Fn&& fn) {
  m.impl(name, std::forward<Fn>(fn));
  note_own_meta_kernel(std::string("aten::") + name);
}

// Referenced by fake mode so that the linker keeps the registrations (a static library's object
// that nothing references is left out, and its registrations with it).
int meta_kernels_linked();
int meta_conv_linked();
int meta_elementwise_linked();
int meta_attention_linked();

}  // namespace ckpt
