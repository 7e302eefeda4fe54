// A C ABI over libtorch's own c10d: a TCPStore for rendezvous and a ProcessGroupGloo for
// the collectives, the engine `torch.distributed` and DDP use on CPU. tch binds none of
// c10d, so src/train/dist.rs calls these through FFI; build.rs compiles this file against
// the headers of the libtorch the crate links.
//
// Tensors cross the boundary as `at::Tensor*` (what torch-sys's `tensor` is). Every function
// returns NULL on success or a malloc'd error message (free it with lk_c10d_free_err): no
// C++ exception crosses into Rust. The collectives and the store functions take either
// kind of group, gloo's or NCCL's (nccl.cpp).
//
// gloo's own headers do not ship with the torch wheel; ProcessGroupGloo.hpp is compiled
// against the declarations in gloo-stub/ (see gloo-stub/gloo/stub.h for the rule that keeps
// that sound).
#include "shim.h"

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <chrono>
#include <string>
#include <vector>

using lakeml::Group;

extern "C" {

void lk_c10d_free_err(char* e) { std::free(e); }

// Joins the group. The store is at host:port; `is_server` hosts it here (rank 0, unless a
// launcher's agent hosts it). Keys go under `prefix`. Gloo binds `iface` when it is not
// empty (GLOO_SOCKET_IFNAME), else the address `bind_host`.
char* lk_c10d_group_new(const char* host, int port, int is_server, const char* prefix,
                        int rank, int world, int timeout_ms, const char* iface,
                        const char* bind_host, void** out) {
  *out = nullptr;
  LK_GUARD({
    auto timeout = std::chrono::milliseconds(timeout_ms);
    c10d::TCPStoreOptions so;
    so.port = static_cast<std::uint16_t>(port);
    so.isServer = is_server != 0;
    so.numWorkers = static_cast<std::size_t>(world);
    // Every client counts itself in; the server waits until all `world` have.
    so.waitWorkers = true;
    so.timeout = timeout;
    c10::intrusive_ptr<c10d::Store> tcp = c10::make_intrusive<c10d::TCPStore>(std::string(host), so);
    c10::intrusive_ptr<c10d::Store> store =
        c10::make_intrusive<c10d::PrefixStore>(std::string(prefix), tcp);

    auto opts = c10d::ProcessGroupGloo::Options::create(timeout);
    if (iface[0])
      opts->devices.push_back(c10d::ProcessGroupGloo::createDeviceForInterface(iface));
    else
      opts->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname(bind_host));
    auto pg = c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, world, opts);
    *out = new Group{store, pg};
  })
}

// Leaves the group: a clean shutdown (NCCL flushes its work and destroys its communicator,
// as destroy_process_group() does), or an abort after a failed collective, which does not
// wait for ranks that are gone. Both do nothing for gloo.
void lk_c10d_group_free(void* g, int failed) {
  auto* group = static_cast<Group*>(g);
  try {
    if (failed)
      group->pg->abort();
    else
      group->pg->shutdown();
  } catch (...) {
  }
  delete group;
}

// In-place sum over every rank. A dense, contiguous tensor.
char* lk_c10d_allreduce_sum(void* g, at::Tensor* t) {
  LK_GUARD({
    std::vector<at::Tensor> ts{*t};
    c10d::AllreduceOptions o;
    o.reduceOp = c10d::ReduceOp::SUM;
    static_cast<Group*>(g)->pg->allreduce(ts, o)->wait();
  })
}

// In place: every rank ends with `root`'s values.
char* lk_c10d_broadcast(void* g, at::Tensor* t, int root) {
  LK_GUARD({
    std::vector<at::Tensor> ts{*t};
    c10d::BroadcastOptions o;
    o.rootRank = root;
    static_cast<Group*>(g)->pg->broadcast(ts, o)->wait();
  })
}

// Sets `key` in the group's store (the value does not matter).
char* lk_c10d_store_set(void* g, const char* key) {
  LK_GUARD({ static_cast<Group*>(g)->store->set(key, std::vector<uint8_t>{1}); })
}

// Whether `key` is in the group's store, without waiting.
char* lk_c10d_store_check(void* g, const char* key, int* present) {
  *present = 0;
  LK_GUARD({ *present = static_cast<Group*>(g)->store->check({std::string(key)}) ? 1 : 0; })
}

}  // extern "C"
