# ctest Build.InstalledPackageBuildsAnOutsideProject (cmake -P): installs the build into a scratch
# prefix, then configures examples/ as an outside project that only knows the prefix, builds one
# example and runs it.
#   -DFSDP_BUILD_DIR  the fsdp.cpp build tree      -DFSDP_SOURCE_DIR  its sources
#   -DWORK_DIR        scratch directory             -DGENERATOR        CMake generator
#   -DCXX_COMPILER    the compiler that built fsdp.cpp (optional; the outside project uses it)
#   -DCCACHE          ccache program (optional)
function(run)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    string(REPLACE ";" " " cmd "${ARGN}")
    message(FATAL_ERROR "Build.InstalledPackageBuildsAnOutsideProject: '${cmd}' failed (${rc}):\n${out}\n${err}")
  endif()
  set(out "${out}" PARENT_SCOPE)
endfunction()

file(REMOVE_RECURSE ${WORK_DIR})
set(prefix ${WORK_DIR}/prefix)
run(${CMAKE_COMMAND} --install ${FSDP_BUILD_DIR} --prefix ${prefix})
foreach(f include/fsdp/fsdp.h lib/cmake/fsdp/fsdpConfig.cmake bin/fsdp-train)
  if(NOT EXISTS ${prefix}/${f})
    message(FATAL_ERROR "Build.InstalledPackageBuildsAnOutsideProject: ${prefix}/${f} was not installed")
  endif()
endforeach()
# No private header may be installed: the public headers stand on their own.
file(GLOB_RECURSE installed_headers RELATIVE ${prefix}/include ${prefix}/include/*.h)
foreach(h ${installed_headers})
  if(NOT h MATCHES "^fsdp/")
    message(FATAL_ERROR "Build.InstalledPackageBuildsAnOutsideProject: unexpected header ${h} installed")
  endif()
endforeach()

# The installed programs start from the prefix: they find the libtorch they were built against.
run(${prefix}/bin/fsdp-train --help)
if(NOT out MATCHES "--strategy")
  message(FATAL_ERROR "Build.InstalledPackageBuildsAnOutsideProject: ${prefix}/bin/fsdp-train --help printed no help:\n${out}")
endif()
run(${prefix}/bin/fsdp-train --model transformer-tiny --data synthetic --devices 2 --backend gloo
    --strategy fsdp --max-steps 2 --no-progress-bar --default-root-dir ${WORK_DIR}/logs)
if(NOT out MATCHES "2 steps")
  message(FATAL_ERROR "Build.InstalledPackageBuildsAnOutsideProject: the installed fsdp-train did not train 2 steps:\n${out}")
endif()

# The outside project sees only the prefix: no source tree, no build tree on its paths.
set(launcher)
if(CCACHE)
  set(launcher -DCMAKE_CXX_COMPILER_LAUNCHER=${CCACHE})
endif()
set(compiler)
if(CXX_COMPILER)
  set(compiler -DCMAKE_CXX_COMPILER=${CXX_COMPILER})
endif()
run(${CMAKE_COMMAND} -S ${FSDP_SOURCE_DIR}/examples -B ${WORK_DIR}/build -G ${GENERATOR}
    -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH=${prefix} ${compiler} ${launcher})
# Only the program it runs: the other examples compile from the same public headers inside the
# build (with its precompiled header), and each example here parses all of libtorch again.
run(${CMAKE_COMMAND} --build ${WORK_DIR}/build --target train_transformer)

# And the program runs: one rank, two steps on the synthetic corpus.
run(${WORK_DIR}/build/train_transformer --devices 1 --strategy single --max-steps 2)
if(NOT out MATCHES "fit done: 2 steps")
  message(FATAL_ERROR "Build.InstalledPackageBuildsAnOutsideProject: train_transformer did not train 2 steps:\n${out}")
endif()
message(STATUS "Build.InstalledPackageBuildsAnOutsideProject: installed, found, built and ran train_transformer")
