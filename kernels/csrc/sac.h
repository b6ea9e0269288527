// Selective activation checkpointing's hook in the Fake key's fallback (sac.cpp).
#pragma once

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>

#include <functional>

namespace ckpt {

// Runs one operator through selective checkpointing when a selective block records or replays
// on this thread: `run` computes it the way the fallback would without the mode.
void sac_call(const c10::OperatorHandle& op, torch::jit::Stack* stack, const std::function<void()>& run);

// Whether a selective block records or replays on this thread.
bool sac_active();

}  // namespace ckpt
