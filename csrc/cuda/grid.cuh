// Grid sizing shared by the launchers. Torch-free.
#pragma once

#include <cstdint>

namespace mrtpo {
namespace cuda {

// One CTA per row, capped so gridDim.x fits its limit (2^31 - 1); kernels stride over rows
// beyond the cap.
inline unsigned rows_grid(int64_t n_rows) {
  constexpr int64_t kMaxGrid = (int64_t{1} << 31) - 1;
  return static_cast<unsigned>(n_rows < kMaxGrid ? n_rows : kMaxGrid);
}

}  // namespace cuda
}  // namespace mrtpo
