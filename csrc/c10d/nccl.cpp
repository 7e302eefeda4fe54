// The NCCL half of the c10d shim (shim.cpp has the gloo half and the functions both share):
// a ProcessGroupNCCL, the engine `torch.distributed` and DDP use on CUDA, joined through
// the store the gloo group already met at. build.rs compiles it only where libtorch has
// CUDA and NCCL's and CUDA's headers are installed, and then sets cfg `lakeml_nccl`.
//
// The same rules as shim.cpp: NULL on success or a malloc'd error message, no C++
// exception crosses into Rust.
#include "shim.h"

#include <ATen/ATen.h>
#include <c10/cuda/CUDAFunctions.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>

#include <chrono>
#include <cstdlib>
#include <string>

using lakeml::Group;

extern "C" {

// An NCCL group of the ranks of `gloo` (a group from lk_c10d_group_new), on CUDA device
// `device`, its keys in gloo's store under `prefix`. The communicator is created now, as
// init_process_group(device_id=...) does, so a GPU problem shows before any training.
char* lk_c10d_nccl_new(void* gloo, const char* prefix, int rank, int world, int timeout_ms,
                       int device, void** out) {
  *out = nullptr;
  LK_GUARD({
    // Training is seeded to be repeatable: leave out NVLS, whose reductions are not.
    setenv("NCCL_ALGO", "^NVLS", 0);
    // A failed or timed-out collective then throws from wait() (and reaches the caller's
    // error, which names the lost rank) instead of the watchdog ending the process.
    setenv("TORCH_NCCL_BLOCKING_WAIT", "1", 0);
    at::Device dev(at::kCUDA, static_cast<c10::DeviceIndex>(device));
    c10::cuda::set_device(dev.index());
    c10::intrusive_ptr<c10d::Store> store =
        c10::make_intrusive<c10d::PrefixStore>(std::string(prefix), static_cast<Group*>(gloo)->store);
    // Options::create takes no timeout, unlike gloo's: it is Backend::Options::timeout.
    auto opts = c10d::ProcessGroupNCCL::Options::create();
    opts->timeout = std::chrono::milliseconds(timeout_ms);
    auto pg = c10::make_intrusive<c10d::ProcessGroupNCCL>(store, rank, world, opts);
    pg->setBoundDeviceId(dev);
    pg->eagerConnectSingleDevice(dev);
    *out = new Group{store, pg};
  })
}

}  // extern "C"
