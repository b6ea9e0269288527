// What CPU kernels allocate beyond what their meta kernels do (`cpu_extras.cpp`).
#pragma once

#include <ATen/core/ivalue.h>
#include <ATen/core/operator_name.h>

#include <vector>

namespace ckpt {

// Replays, in fake mode, the temporaries the CPU implementation of an operator allocates after
// its outputs exist, given the call's arguments and results.
using CpuExtras = void (*)(const std::vector<c10::IValue>& args, const std::vector<c10::IValue>& results);

// The replay for `name`, or null where the meta kernel already allocates what the CPU does.
CpuExtras cpu_extras(const c10::OperatorName& name);

}  // namespace ckpt
