// Host-emulation shim for <cuda_fp16.h>; see cuda_emulator.h.
#pragma once

#include "cuda_emulator.h"
