#![no_main]

// The guard enforces the allocation bound under any sanitizer, or none
// (libFuzzer's -malloc_limit_mb relies on a sanitizer's malloc hooks), and
// aborts so that libFuzzer saves the input.
#[global_allocator]
static ALLOC: kvgate_fuzz::guard::GuardAlloc = kvgate_fuzz::guard::GuardAlloc;

libfuzzer_sys::fuzz_target!(
    init: kvgate_fuzz::guard::set_abort(true),
    |d: &[u8]| kvgate_fuzz::template(d)
);
