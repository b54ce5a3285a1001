//! An allocation bound for fuzzing: a global allocator over [`System`] that
//! records the largest single request per thread and reports any request
//! over a configured bound.
//!
//! A decoder that trusts a length field shows up here long before it takes
//! a sidecar or Envoy down: one hostile header asking for gigabytes is one
//! oversized request, whatever the machine's overcommit policy then does
//! with it. The type lives in the library, but only binaries and tests
//! install it (`#[global_allocator] static A: GuardAlloc = GuardAlloc;`):
//! a library must not choose its users' allocator.
//!
//! An over-bound request is written to stderr at once, with the target and
//! the whole input in hex, because the request may abort the process
//! before any harness gets to report it. Then, with [`set_abort`], the
//! process aborts (what libFuzzer and the runner want: the input is the
//! crash); otherwise it is passed on and flagged for [`end`] to return.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

/// The bound the issue sets: no single allocation of decoding outside
/// input may exceed 64 MiB.
pub const DEFAULT_LIMIT: usize = 64 << 20;

static LIMIT: AtomicUsize = AtomicUsize::new(DEFAULT_LIMIT);
static ABORT: AtomicBool = AtomicBool::new(false);
static INSTALLED: AtomicBool = AtomicBool::new(false);

// Const-initialised and without destructors, so reading them inside the
// allocator never allocates and never fails, even during thread exit.
thread_local! {
    static PEAK: Cell<usize> = const { Cell::new(0) };
    static OVER: Cell<usize> = const { Cell::new(0) };
    static INPUT: Cell<(*const u8, usize)> = const { Cell::new((std::ptr::null(), 0)) };
    static TARGET: Cell<&'static str> = const { Cell::new("") };
    static QUIET: Cell<bool> = const { Cell::new(false) };
}

/// The allocator. Install it with `#[global_allocator]`.
pub struct GuardAlloc;

// SAFETY: every method forwards to `System` with the caller's arguments
// unchanged; the bookkeeping around it neither allocates nor unwinds.
unsafe impl GlobalAlloc for GuardAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        check(layout.size());
        // SAFETY: the caller upholds `GlobalAlloc::alloc`'s contract.
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        check(layout.size());
        // SAFETY: as for `alloc`.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` came from `System` through this allocator.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        check(new_size);
        // SAFETY: as for `dealloc`, and the caller upholds `realloc`'s contract.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[inline]
fn check(size: usize) {
    INSTALLED.store(true, Ordering::Relaxed);
    let _ = PEAK.try_with(|p| {
        if size > p.get() {
            p.set(size);
        }
    });
    let limit = LIMIT.load(Ordering::Relaxed);
    if size > limit {
        over_bound(size, limit);
    }
}

#[cold]
fn over_bound(size: usize, limit: usize) {
    let _ = OVER.try_with(|o| o.set(o.get().max(size)));
    if !QUIET.try_with(Cell::get).unwrap_or(false) {
        report(size, limit);
    }
    if ABORT.load(Ordering::Relaxed) {
        std::process::abort();
    }
}

/// Whether a [`GuardAlloc`] is the process's allocator (it has seen an
/// allocation). Harnesses assert it, so a forgotten `#[global_allocator]`
/// cannot silently turn the bound off.
pub fn installed() -> bool {
    // Make sure at least one allocation has gone through whatever the
    // global allocator is.
    drop(std::hint::black_box(Box::new(0u8)));
    INSTALLED.load(Ordering::Relaxed)
}

/// Sets the bound for single allocations, in bytes.
pub fn set_limit(bytes: usize) {
    LIMIT.store(bytes, Ordering::Relaxed);
}

pub fn limit() -> usize {
    LIMIT.load(Ordering::Relaxed)
}

/// Abort the process on an over-bound request instead of flagging it.
pub fn set_abort(abort: bool) {
    ABORT.store(abort, Ordering::Relaxed);
}

/// Leaves over-bound requests of this thread unreported (still flagged),
/// for the guard's own test.
pub fn set_quiet(quiet: bool) {
    QUIET.with(|q| q.set(quiet));
}

/// Starts watching one input on this thread: clears the peak and the flag
/// and names what an over-bound report should print.
pub fn begin(target: &'static str, input: &[u8]) {
    PEAK.with(|p| p.set(0));
    OVER.with(|o| o.set(0));
    TARGET.with(|t| t.set(target));
    INPUT.with(|i| i.set((input.as_ptr(), input.len())));
}

/// What this thread allocated since [`begin`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Watch {
    /// Largest single request, in bytes.
    pub peak: usize,
    /// Largest request over the bound, 0 when none.
    pub over: usize,
}

/// Stops watching: forgets the input (its borrow ends here) and returns
/// what was seen.
pub fn end() -> Watch {
    INPUT.with(|i| i.set((std::ptr::null(), 0)));
    TARGET.with(|t| t.set(""));
    Watch {
        peak: PEAK.with(Cell::get),
        over: OVER.with(Cell::get),
    }
}

/// Writes the report to fd 2 from a stack buffer: the allocator must not
/// allocate, and stderr's lock may already be held by this thread.
fn report(size: usize, limit: usize) {
    use std::fmt::Write as _;
    let mut line = StackBuf::new();
    let target = TARGET.try_with(Cell::get).unwrap_or("");
    let (ptr, len) = INPUT.try_with(Cell::get).unwrap_or((std::ptr::null(), 0));
    let _ = write!(
        line,
        "\nkvgate-fuzz: one allocation of {size} bytes, over the {limit}-byte bound, \
         target {target:?}, input of {len} bytes (hex follows)\n"
    );
    raw_stderr(line.as_bytes());
    if ptr.is_null() {
        return;
    }
    // SAFETY: `begin` stored a live slice's pointer and length, and `end`
    // clears them before that borrow ends; this thread is inside the
    // target call that borrows it.
    let input = unsafe { std::slice::from_raw_parts(ptr, len) };
    for chunk in input.chunks(256) {
        let mut hex = StackBuf::new();
        for b in chunk {
            let _ = write!(hex, "{b:02x}");
        }
        raw_stderr(hex.as_bytes());
    }
    raw_stderr(b"\n");
}

#[cfg(unix)]
fn raw_stderr(bytes: &[u8]) {
    use std::io::Write as _;
    use std::os::fd::FromRawFd as _;
    // SAFETY: fd 2 stays open for the life of the process, and
    // `ManuallyDrop` keeps this handle from closing it.
    let mut f = std::mem::ManuallyDrop::new(unsafe { std::fs::File::from_raw_fd(2) });
    let _ = f.write_all(bytes);
}

#[cfg(not(unix))]
fn raw_stderr(_bytes: &[u8]) {}

struct StackBuf {
    buf: [u8; 640],
    len: usize,
}

impl StackBuf {
    fn new() -> Self {
        StackBuf {
            buf: [0; 640],
            len: 0,
        }
    }

    fn as_bytes(&self) -> &[u8] {
        &self.buf[..self.len]
    }
}

impl std::fmt::Write for StackBuf {
    fn write_str(&mut self, s: &str) -> std::fmt::Result {
        // Truncates rather than fails: a clipped report beats none.
        let n = s.len().min(self.buf.len() - self.len);
        self.buf[self.len..self.len + n].copy_from_slice(&s.as_bytes()[..n]);
        self.len += n;
        Ok(())
    }
}
