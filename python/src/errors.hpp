// membound's typed errors as the Python exceptions of membound/_errors.py, with their fields: one
// translator for every extension module of the package (_core, _layers).
#pragma once

#include <nanobind/nanobind.h>

#include <exception>

#include "membound/core/error.hpp"
#include "membound/model/planner.hpp"  // budget_too_small, host_budget_too_small

namespace membound_python {

namespace nb = nanobind;
namespace mb = membound;

// Registers the translator; call once in each module's NB_MODULE body.
inline void translate_errors() {
  // The classes live as long as the interpreter: leaked on purpose (no destructor at exit).
  static nb::object* types = [] {
    const nb::module_ errors = nb::module_::import_("membound._errors");
    return new nb::object[3]{errors.attr("InvalidArgument"), errors.attr("BudgetTooSmall"),
                             errors.attr("OutOfMemory")};
  }();
  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    const nb::object &invalid = types[0], &budget = types[1], &oom = types[2];
    const auto raise = [](const nb::object& type, const nb::object& instance) {
      PyErr_SetObject(type.ptr(), instance.ptr());
    };
    try {
      std::rethrow_exception(p);
    } catch (const mb::budget_too_small& e) {
      raise(budget, budget(e.what(), e.argument(), e.expected(), e.actual(), e.what_to_do(), e.budget(), e.minimum()));
    } catch (const mb::host_budget_too_small& e) {
      // Named as the Python argument is.
      const mb::invalid_argument named("host_budget", e.expected(), e.actual(), e.what_to_do());
      raise(invalid, invalid(named.what(), named.argument(), named.expected(), named.actual(), named.what_to_do()));
    } catch (const mb::invalid_argument& e) {
      raise(invalid, invalid(e.what(), e.argument(), e.expected(), e.actual(), e.what_to_do()));
    } catch (const mb::out_of_memory& e) {
      raise(oom, oom(e.what(), e.report().requested));
    }
  });
}

}  // namespace membound_python
