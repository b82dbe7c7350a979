// Host-emulation shim for <cuda_bf16.h>; see cuda_emulator.h.
#pragma once

#include "cuda_emulator.h"
