# ctest Build.UmbrellaHeaderIncludesEveryPublicHeader: include/fsdp/fsdp.h, "the whole public
# API", includes every other header of include/fsdp/ (a header added without listing it there
# fails here).
#   cmake -DSOURCE_DIR=... -P umbrella_header.cmake
file(READ "${SOURCE_DIR}/include/fsdp/fsdp.h" umbrella)
file(GLOB headers RELATIVE "${SOURCE_DIR}/include" "${SOURCE_DIR}/include/fsdp/*.h")
set(missing)
foreach(h ${headers})
  if(h STREQUAL "fsdp/fsdp.h")
    continue()
  endif()
  string(FIND "${umbrella}" "#include \"${h}\"" at)
  if(at EQUAL -1)
    list(APPEND missing "${h}")
  endif()
endforeach()
if(missing)
  string(REPLACE ";" ", " missing "${missing}")
  message(FATAL_ERROR "include/fsdp/fsdp.h does not include ${missing}: add an #include line "
                      "for each (QLoRA headers inside its __has_include block)")
endif()
list(LENGTH headers n)
math(EXPR n "${n} - 1")
message(STATUS "fsdp.h includes all ${n} other public headers")
