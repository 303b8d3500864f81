#pragma once
// A native crash report: which thread died, on which signal, and its C/C++ call stack.
//
// Python's faulthandler prints the Python stacks of a crashed process but not the native frames,
// and not which native thread (an NCCL proxy, torch's watchdog, a resilient writer) crashed. The
// handler installed here writes that to stderr and then hands the signal on to whatever handler
// was installed before it (faulthandler, a sanitizer) or to the default action, so the process
// still dies with the same signal and core-dump behaviour.

namespace resilient {

/// Installs the crash handler for SIGSEGV, SIGBUS, SIGILL, SIGFPE and SIGABRT. Idempotent and
/// thread-safe. The report is written with async-signal-safe calls only:
///   resilient: fatal signal 11 (SIGSEGV), address 0x0, thread 4242 "pt_nccl_watchdg"
///   <one backtrace_symbols_fd line per frame>
/// RESILIENT_CRASH_HANDLER=1 makes `import resilient` install it.
void install_crash_handler();

}  // namespace resilient
