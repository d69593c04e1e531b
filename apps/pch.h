// Precompiled header of the programs: apps/, bench/ (fsdp-bench) and examples/ (see
// fsdp_pch_apps in CMakeLists.txt). src/pch.h plus the command-line and JSON libraries they all
// parse; nothing of fsdp.cpp's own.
#pragma once
#include "../src/pch.h"

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>
