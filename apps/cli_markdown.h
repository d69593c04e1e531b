// `PROG --help-markdown`: the program's --help as Markdown, for docs/cli.md.
//
// Note [Generated CLI reference]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// docs/cli.md is made from the same CLI11 definitions as --help: every program's parse()
// (apps/cli.h) answers the hidden flag --help-markdown with one section per program and
// subcommand, one table per option group (in the order --help shows them), each flag with its
// names, value type and checks, default and description. cmake/cli_docs.cmake runs the
// programs and writes docs/cli.md (`cmake --build build --target cli-docs`); the ctest
// Docs.CliReferenceIsUpToDate runs the same and fails when docs/cli.md differs, so a flag added,
// renamed or re-described without regenerating the file is caught.
#pragma once

#include <CLI/CLI.hpp>

#include <ostream>
#include <string>
#include <vector>

namespace fsdp::cli::detail {

// One line of a Markdown table cell: '|' escaped, line breaks as spaces.
inline std::string table_cell(const std::string& text) {
  std::string out;
  for (char c : text) {
    if (c == '|') {
      out += "\\|";
    } else if (c == '\n') {
      out += ' ';
    } else {
      out += c;
    }
  }
  while (!out.empty() && out.back() == ' ') out.pop_back();
  return out;
}

// "`-h`, `--help`" from CLI11's "-h,--help"; a positional's name as it is. A negated flag's name
// comes without the value CLI11 appends to it ("--no-x{false}" is typed "--no-x").
inline std::string markdown_names(const CLI::Option* o) {
  if (o->get_lnames().empty() && o->get_snames().empty()) return "`" + o->get_name(true) + "`";
  std::string names = o->get_name(false, true), out;
  size_t start = 0;
  while (start <= names.size()) {
    size_t comma = names.find(',', start);
    if (comma == std::string::npos) comma = names.size();
    std::string name = names.substr(start, comma - start);
    if (const size_t brace = name.find('{'); brace != std::string::npos) name.resize(brace);
    if (!name.empty()) out += (out.empty() ? "`" : ", `") + name + "`";
    start = comma + 1;
  }
  return out;
}

inline void help_markdown(const CLI::App& app, const std::string& title, std::ostream& out) {
  out << "## " << title << "\n\n";
  if (!app.get_description().empty()) out << table_cell(app.get_description()) << "\n\n";
  for (const std::string& group : app.get_groups()) {
    if (group.empty()) continue;  // hidden flags
    std::vector<const CLI::Option*> options;
    for (const CLI::Option* o : app.get_options()) {
      if (o->get_group() != group || o->get_name() == "--help" || o->get_name() == "--help-all" ||
          o->get_name() == "--help-markdown") {
        continue;
      }
      options.push_back(o);
    }
    if (options.empty()) continue;
    out << "### " << group << "\n\n| flag | value | default | description |\n|---|---|---|---|\n";
    for (const CLI::Option* o : options) {
      std::string value = o->get_type_size() == 0 ? "" : o->get_type_name();
      if (o->get_required()) value += value.empty() ? "required" : " (required)";
      const std::string def = o->get_default_str();
      out << "| " << markdown_names(o) << " | " << table_cell(value) << " | "
          << (def.empty() ? "" : "`" + table_cell(def) + "`") << " | "
          << table_cell(o->get_description()) << " |\n";
    }
    out << "\n";
  }
  if (!app.get_footer().empty()) out << table_cell(app.get_footer()) << "\n\n";
  for (const CLI::App* sub : app.get_subcommands({})) {
    help_markdown(*sub, title + " " + sub->get_name(), out);
  }
}

}  // namespace fsdp::cli::detail
