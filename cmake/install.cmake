# cmake --install: the libraries, the public headers, the programs and a CMake package, so that
#
#   find_package(fsdp REQUIRED)
#   target_link_libraries(app PRIVATE fsdp::fsdp)
#
# works in a user's own project (README "Using fsdp.cpp from your CMake project").
include(CMakePackageConfigHelpers)

set(FSDP_CMAKE_DIR ${CMAKE_INSTALL_LIBDIR}/cmake/fsdp)
install(TARGETS fsdp fsdp_nn fsdp_runtime EXPORT fsdpTargets
        ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR})
if(FSDP_WITH_QLORA)
  install(DIRECTORY ${PROJECT_SOURCE_DIR}/include/fsdp DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
else()  # without FSDP_WITH_QLORA its headers have no library behind them
  install(DIRECTORY ${PROJECT_SOURCE_DIR}/include/fsdp DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}
          REGEX "/(causal_lm_data|hf|linear|llama|lora|optim8bit|quantization|tokenizer)\\.h$" EXCLUDE)
endif()
if(FSDP_APPS)
  install(TARGETS ${FSDP_APPS} RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
endif()
install(EXPORT fsdpTargets NAMESPACE fsdp:: DESTINATION ${FSDP_CMAKE_DIR})

# The package remembers the libtorch it was built against (a consumer that found libtorch
# first keeps its own; it must be the same one).
set(FSDP_TORCH_DIR "${Torch_DIR}")
set(FSDP_KINETO_LIBRARY "${kineto_LIBRARY}")
configure_package_config_file(${PROJECT_SOURCE_DIR}/cmake/fsdpConfig.cmake.in
                              ${PROJECT_BINARY_DIR}/fsdpConfig.cmake
                              INSTALL_DESTINATION ${FSDP_CMAKE_DIR})
write_basic_package_version_file(${PROJECT_BINARY_DIR}/fsdpConfigVersion.cmake
                                 COMPATIBILITY SameMinorVersion)
install(FILES ${PROJECT_BINARY_DIR}/fsdpConfig.cmake ${PROJECT_BINARY_DIR}/fsdpConfigVersion.cmake
        DESTINATION ${FSDP_CMAKE_DIR})
