// membound: configuration, version and the ABI namespace.
// Host-only: never includes CUDA headers, so every consumer builds with plain g++.
#pragma once

// membound is C++20 (concepts, requires, std::span): an older standard stops here, with one
// sentence rather than a hundred errors about concepts. MSVC reports its standard in _MSVC_LANG.
#if defined(_MSVC_LANG) ? (_MSVC_LANG < 202002L) : (__cplusplus < 202002L)
#error "membound needs C++20: compile with -std=c++20 (g++, clang++ and nvcc alike), or link the CMake target membound::membound, which sets it"
// Stop at once: what follows would only add errors about concepts.
#include "membound_stops_here_because_it_needs_cxx20"
#endif

#define MEMBOUND_VERSION_MAJOR 0
#define MEMBOUND_VERSION_MINOR 1
#define MEMBOUND_VERSION_PATCH 0

// The inline namespace encodes the version so that two membound versions linked into one
// program cannot silently mix types (an ODR violation would otherwise go unnoticed).
#define MEMBOUND_ABI_CONCAT_(a, b, c) v##a##_##b##_##c
#define MEMBOUND_ABI_NAME_(a, b, c) MEMBOUND_ABI_CONCAT_(a, b, c)
#define MEMBOUND_ABI_NAMESPACE \
  MEMBOUND_ABI_NAME_(MEMBOUND_VERSION_MAJOR, MEMBOUND_VERSION_MINOR, MEMBOUND_VERSION_PATCH)

#define MEMBOUND_NAMESPACE_BEGIN \
  namespace membound {           \
  inline namespace MEMBOUND_ABI_NAMESPACE {
#define MEMBOUND_NAMESPACE_END \
  }                            \
  }

// Three separate questions, as Eigen keeps them apart:
//   MEMBOUND_CUDA_COMPILER : is this translation unit compiled by nvcc (host or device pass)?
//   MEMBOUND_DEVICE_PASS   : is this the device pass?
//   MEMBOUND_NO_CUDA       : did the user opt out of CUDA even when compiling with nvcc?
#if defined(__CUDACC__) && !defined(MEMBOUND_NO_CUDA)
#define MEMBOUND_CUDA_COMPILER 1
#define MEMBOUND_HOST_DEVICE __host__ __device__
#else
#define MEMBOUND_CUDA_COMPILER 0
#define MEMBOUND_HOST_DEVICE
#endif

#if defined(__CUDA_ARCH__)
#define MEMBOUND_DEVICE_PASS 1
#else
#define MEMBOUND_DEVICE_PASS 0
#endif

MEMBOUND_NAMESPACE_BEGIN

struct version_info {
  int major, minor, patch;
};
inline constexpr version_info version{MEMBOUND_VERSION_MAJOR, MEMBOUND_VERSION_MINOR,
                                      MEMBOUND_VERSION_PATCH};

// A type-dependent false, so that static_assert in a discarded branch fires only when instantiated.
template <typename...>
inline constexpr bool dependent_false = false;

MEMBOUND_NAMESPACE_END
