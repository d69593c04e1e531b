# ctest: configuring fsdp.cpp against a libtorch older than 2.0 stops with a message that says so.
# A fake Torch package of version 1.13.1 (what Debian's libtorch-dev ships) stands in for the old
# libtorch; the real configure step of the project runs against it.
#   cmake -DSOURCE_DIR=... -DWORK_DIR=... -P old_libtorch_is_refused.cmake
file(REMOVE_RECURSE "${WORK_DIR}")
set(fake "${WORK_DIR}/libtorch-1.13")
file(WRITE "${fake}/share/cmake/Torch/TorchConfigVersion.cmake" [=[
set(PACKAGE_VERSION "1.13.1")
set(PACKAGE_VERSION_COMPATIBLE TRUE)
]=])
file(WRITE "${fake}/share/cmake/Torch/TorchConfig.cmake" [=[
set(TORCH_FOUND TRUE)
set(TORCH_LIBRARIES torch)
set(TORCH_INCLUDE_DIRS "")
]=])
execute_process(
  COMMAND "${CMAKE_COMMAND}" -S "${SOURCE_DIR}" -B "${WORK_DIR}/build" -G Ninja
          "-DFSDP_LIBTORCH=${fake}" -DFSDP_BUILD_TESTS=OFF
  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
file(REMOVE_RECURSE "${WORK_DIR}")
if(rc EQUAL 0)
  message(FATAL_ERROR "configure against libtorch 1.13.1 succeeded; it must fail:\n${out}${err}")
endif()
foreach(needle "fsdp.cpp needs libtorch 2.x" "'1.13.1'" "FSDP_LIBTORCH")
  string(FIND "${err}" "${needle}" at)
  if(at EQUAL -1)
    message(FATAL_ERROR "configure failed without saying '${needle}':\n${err}")
  endif()
endforeach()
message(STATUS "refused as expected")
