# ctest: misuses of the wrapping API (tests/compile_errors/misuse.cpp) fail to compile with the
# static_assert sentence that says what to do instead.
#   cmake -DBUILD_DIR=... -P compile_errors.cmake
set(cases
  "compile_error_wrap_module_handle|fsdp::wrap takes a std::shared_ptr to an fsdp::nn::Module"
  "compile_error_wrap_sequential_child|fsdp::nn::unit_children(seq)"
  "compile_error_unit_of_tuple_forward|forward must take tensors")
foreach(case ${cases})
  string(REPLACE "|" ";" parts "${case}")
  list(GET parts 0 target)
  list(GET parts 1 needle)
  execute_process(COMMAND "${CMAKE_COMMAND}" --build "${BUILD_DIR}" --target ${target}
                  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(rc EQUAL 0)
    message(FATAL_ERROR "${target} compiled; it must be a compile-time error")
  endif()
  string(FIND "${out}${err}" "${needle}" at)
  if(at EQUAL -1)
    message(FATAL_ERROR "${target} failed without saying '${needle}':\n${out}${err}")
  endif()
  message(STATUS "${target}: refused with '${needle}'")
endforeach()
