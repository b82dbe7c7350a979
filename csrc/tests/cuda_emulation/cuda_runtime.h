// Host-emulation shim for <cuda_runtime.h>; see cuda_emulator.h.
#pragma once

#include "cuda_emulator.h"
