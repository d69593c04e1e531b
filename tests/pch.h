// Precompiled header of the test programs (see fsdp_pch_tests in tests/CMakeLists.txt):
// src/pch.h plus the third-party and standard headers most test files parse. Nothing of
// fsdp.cpp's own, so a test that forgets to include an fsdp header still fails to compile.
#pragma once
#include "../src/pch.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>
#include <random>
