# docs/cli.md from the programs' own flag definitions (Note [Generated CLI reference] in
# apps/cli_markdown.h): runs `PROG --help-markdown` for each program and
#   -DMODE=write  writes OUT (the cli-docs target: `cmake --build build --target cli-docs`)
#   -DMODE=check  fails when OUT differs (the ctest Docs.CliReferenceIsUpToDate), leaving what
#                 it should hold in EXPECTED
#   -DBIN_DIR=build/bin  -DOUT=docs/cli.md  -DPROGRAMS=fsdp-train,fsdp-finetune,...
set(doc "# Command-line reference

The flags of every program, generated from the same definitions as their `--help`
(`PROG --help-markdown`). Regenerate after changing a flag:
`cmake --build build --target cli-docs`; the test `Docs.CliReferenceIsUpToDate` fails while this
file is out of date. Guides: [fsdp-train.md](fsdp-train.md), [qlora.md](qlora.md) (fsdp-finetune),
[checkpoints.md](checkpoints.md) (fsdp-ckpt), [launching.md](launching.md) (fsdp-run).

")
string(REPLACE "," ";" PROGRAMS "${PROGRAMS}")
foreach(prog ${PROGRAMS})
  execute_process(COMMAND "${BIN_DIR}/${prog}" --help-markdown
                  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "${BIN_DIR}/${prog} --help-markdown failed (${rc}):\n${err}")
  endif()
  string(APPEND doc "${out}")
endforeach()
string(REGEX REPLACE "\n+$" "\n" doc "${doc}")
if(MODE STREQUAL "write")
  file(WRITE "${OUT}" "${doc}")
  message(STATUS "wrote ${OUT}")
else()
  set(current "")
  if(EXISTS "${OUT}")
    file(READ "${OUT}" current)
  endif()
  if(NOT current STREQUAL doc)
    file(WRITE "${EXPECTED}" "${doc}")
    message(FATAL_ERROR "${OUT} is out of date with the programs' flags (what it should hold "
            "is in ${EXPECTED}; diff the two).\n"
            "---> HINT: cmake --build <build dir> --target cli-docs, then commit docs/cli.md")
  endif()
  message(STATUS "${OUT} matches the programs' flags")
endif()
