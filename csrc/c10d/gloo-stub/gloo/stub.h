// Minimal stand-ins for the 5 gloo headers ProcessGroupGloo.hpp includes.
// ProcessGroupGloo's own layout only holds gloo types behind shared_ptr/unique_ptr,
// so these declarations never affect object layout. Do NOT construct GlooStore or call
// setTimeout()/anything gloo-typed from the shim: those would need the real definitions.
#pragma once
#include <chrono>
#include <string>
#include <vector>
namespace gloo {
class Context {
 public:
  void setTimeout(std::chrono::milliseconds timeout);  // only named by an inline member; never called
};
namespace transport {
class Device;
class UnboundBuffer;
} // namespace transport
namespace rendezvous {
class Store {  // base of c10d::ProcessGroupGloo::GlooStore (never instantiated by the shim)
 public:
  virtual ~Store() = default;
  virtual void set(const std::string& key, const std::vector<char>& data) = 0;
  virtual std::vector<char> get(const std::string& key) = 0;
  virtual void wait(const std::vector<std::string>& keys) = 0;
  virtual void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) = 0;
};
} // namespace rendezvous
} // namespace gloo
