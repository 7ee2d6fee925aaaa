//! The module's global allocator: large blocks straight from the kernel.
//!
//! Inside Envoy, the system allocator is Envoy's tcmalloc. It keeps what the
//! module frees: a block of a few hundred KiB to a few MiB (the index's
//! buffer, the engine's slice of bucket lines, the guard's baseline table,
//! the module's copy of the answer, the member lists' buffer) takes pages
//! inside huge pages that small live objects share, and Envoy's periodic
//! release only gives back whole free huge pages (docs/native.md, "Numbers"). So a block of [`LARGE`] bytes or
//! more is mapped on its own (`mmap`), grown or shrunk in place or moved by
//! the kernel (`mremap`), and unmapped when freed (`munmap`): its pages go
//! back to the kernel at once and never share a huge page with small
//! objects. Everything else, which is all the request path allocates, goes
//! to the system allocator as before.
//!
//! A mapping is page-aligned; a large block that asks for more alignment
//! than [`PAGE`] goes to the system allocator. Envoy never frees a block of
//! the module's (every pointer the module hands it comes back to a module
//! hook to be dropped), so no mapping reaches tcmalloc's `free`. Every binary that links the
//! crate (the cdylib in Envoy, its tests, the benchmarks) allocates through
//! it. Failure is a null pointer, as the [`GlobalAlloc`] contract wants;
//! nothing here panics.

use std::alloc::{GlobalAlloc, Layout, System};
use std::ptr;

/// Blocks of this many bytes or more are mapped on their own. Well above
/// anything the request path allocates (a request's engine state and its
/// texts are a few hundred bytes), and at the top of tcmalloc's size classes
/// (up to 256 KiB), whose free objects it keeps; few enough a sync (a few
/// dozen blocks) that the system calls cost nothing measurable.
pub const LARGE: usize = 128 * 1024;

/// The alignment a mapping is guaranteed: the smallest page size of the
/// platforms Envoy runs on (4 KiB; larger pages align more).
pub const PAGE: usize = 4096;

/// The module's allocator (see the module docs).
#[derive(Debug, Clone, Copy, Default)]
pub struct Allocator;

/// Whether a block of `layout` is mapped on its own.
pub fn is_large(layout: Layout) -> bool {
    layout.size() >= LARGE && layout.align() <= PAGE
}

/// Maps `size` bytes of zeroed, readable and writable memory; null when
/// the kernel refuses.
fn map(size: usize) -> *mut u8 {
    // SAFETY: an anonymous private mapping at an address of the kernel's
    // choice touches no memory of the process; the result is checked.
    let at = unsafe {
        libc::mmap(
            ptr::null_mut(),
            size,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    if at == libc::MAP_FAILED {
        ptr::null_mut()
    } else {
        at.cast()
    }
}

// SAFETY: every block this allocator returns is either the system
// allocator's (for a layout `is_large` rejects) or a mapping of its own (for
// a layout it accepts); `is_large` depends only on the layout, and the
// `GlobalAlloc` contract hands `dealloc` and `realloc` the layout the block
// was allocated (or last reallocated) with, so each block goes back to the
// allocator it came from. A mapping is page-aligned, so it satisfies any
// alignment `is_large` accepts, and it is as large as the layout's size.
unsafe impl GlobalAlloc for Allocator {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if is_large(layout) {
            map(layout.size())
        } else {
            // SAFETY: the caller's layout has a non-zero size (the
            // contract), passed on unchanged.
            unsafe { System.alloc(layout) }
        }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        if is_large(layout) {
            // An anonymous mapping is zeroed by the kernel.
            map(layout.size())
        } else {
            // SAFETY: as in `alloc`.
            unsafe { System.alloc_zeroed(layout) }
        }
    }

    unsafe fn dealloc(&self, block: *mut u8, layout: Layout) {
        if is_large(layout) {
            // SAFETY: `block` is a mapping of `layout.size()` bytes this
            // allocator made (see the impl's SAFETY), which the caller no
            // longer uses. munmap fails only for an address that is not a
            // mapping's; there is nothing to do then but keep it.
            unsafe { libc::munmap(block.cast(), layout.size()) };
        } else {
            // SAFETY: `block` came from `System` with this layout.
            unsafe { System.dealloc(block, layout) }
        }
    }

    unsafe fn realloc(&self, block: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: the contract guarantees that `new_size`, rounded up to
        // `layout.align()` (a power of two), does not overflow `isize`.
        let new = unsafe { Layout::from_size_align_unchecked(new_size, layout.align()) };
        match (is_large(layout), is_large(new)) {
            // SAFETY: `block` came from `System` with `layout`, and `new`
            // is valid (above).
            (false, false) => unsafe { System.realloc(block, layout, new_size) },
            (true, true) => {
                // SAFETY: `block` is a mapping of `layout.size()` bytes
                // made here; the kernel grows or shrinks it in place or
                // moves it whole (its old address is then no mapping), or
                // fails and leaves it as it was.
                let at = unsafe {
                    libc::mremap(block.cast(), layout.size(), new_size, libc::MREMAP_MAYMOVE)
                };
                if at == libc::MAP_FAILED {
                    ptr::null_mut()
                } else {
                    at.cast()
                }
            }
            // Across the threshold: a new block of the other kind, the
            // bytes both hold copied, the old one freed. On failure the old
            // block is left as it was, as the contract wants.
            _ => {
                // SAFETY: `new` has a non-zero size (the contract).
                let moved = unsafe { self.alloc(new) };
                if !moved.is_null() {
                    // SAFETY: both blocks are live, distinct, and at least
                    // this long; the old one is freed with its own layout.
                    unsafe {
                        ptr::copy_nonoverlapping(block, moved, layout.size().min(new_size));
                        self.dealloc(block, layout);
                    }
                }
                moved
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// A block of the allocator's, freed when dropped.
    struct Block {
        at: *mut u8,
        layout: Layout,
    }

    impl Block {
        fn new(size: usize, align: usize) -> Self {
            let layout = Layout::from_size_align(size, align).unwrap();
            // SAFETY: the layout's size is not zero.
            let at = unsafe { Allocator.alloc(layout) };
            assert!(!at.is_null(), "{layout:?}");
            assert_eq!(at as usize % align, 0, "{layout:?}");
            Self { at, layout }
        }

        fn zeroed(size: usize) -> Self {
            let layout = Layout::from_size_align(size, 8).unwrap();
            // SAFETY: the layout's size is not zero.
            let at = unsafe { Allocator.alloc_zeroed(layout) };
            assert!(!at.is_null());
            Self { at, layout }
        }

        fn bytes(&mut self) -> &mut [u8] {
            // SAFETY: `at` is a live block of `layout.size()` bytes, all
            // written (filled, or zeroed) before they are read.
            unsafe { std::slice::from_raw_parts_mut(self.at, self.layout.size()) }
        }

        /// Fills the block with a pattern that names `seed` and each byte's
        /// place.
        fn fill(&mut self, seed: u8) {
            for (i, b) in self.bytes().iter_mut().enumerate() {
                *b = pattern(seed, i);
            }
        }

        /// The first `len` bytes still hold `fill(seed)`'s pattern.
        fn holds(&mut self, seed: u8, len: usize) -> bool {
            self.bytes()[..len]
                .iter()
                .enumerate()
                .all(|(i, b)| *b == pattern(seed, i))
        }

        fn resize(&mut self, new_size: usize) {
            // SAFETY: `at` is this allocator's block of `layout`; sizes
            // here are far from overflowing.
            let at = unsafe { Allocator.realloc(self.at, self.layout, new_size) };
            assert!(!at.is_null());
            assert_eq!(at as usize % self.layout.align(), 0);
            self.at = at;
            self.layout = Layout::from_size_align(new_size, self.layout.align()).unwrap();
        }
    }

    impl Drop for Block {
        fn drop(&mut self) {
            // SAFETY: `at` is this allocator's block of `layout`, freed once.
            unsafe { Allocator.dealloc(self.at, self.layout) }
        }
    }

    fn pattern(seed: u8, i: usize) -> u8 {
        seed ^ (i as u8) ^ ((i >> 8) as u8) ^ ((i >> 16) as u8)
    }

    #[test]
    fn the_threshold_routes_by_size_and_alignment() {
        let layout = |size, align| Layout::from_size_align(size, align).unwrap();
        assert!(!is_large(layout(LARGE - 1, 8)));
        assert!(is_large(layout(LARGE, 1)));
        assert!(is_large(layout(LARGE, PAGE)));
        assert!(!is_large(layout(LARGE, 2 * PAGE)), "over-aligned");
        assert!(!is_large(layout(64, 2 * PAGE)));
    }

    #[test]
    fn a_small_block_keeps_its_bytes() {
        let mut block = Block::new(100, 8);
        block.fill(1);
        assert!(block.holds(1, 100));
    }

    #[test]
    fn a_large_block_is_a_whole_mapping_and_keeps_its_bytes() {
        let mut block = Block::new(LARGE + 3, 16);
        assert_eq!(block.at as usize % PAGE, 0, "a mapping is page-aligned");
        block.fill(2);
        assert!(block.holds(2, LARGE + 3));
    }

    #[test]
    fn a_large_block_grows_and_shrinks_in_the_kernel() {
        let mut block = Block::new(LARGE, 8);
        block.fill(3);
        block.resize(4 * LARGE + 5);
        assert!(block.holds(3, LARGE));
        block.fill(4);
        block.resize(LARGE + 1);
        assert!(block.holds(4, LARGE + 1));
    }

    #[test]
    fn a_block_grown_across_the_threshold_keeps_its_bytes() {
        let mut block = Block::new(1000, 8);
        block.fill(5);
        block.resize(3 * LARGE);
        assert_eq!(block.at as usize % PAGE, 0);
        assert!(block.holds(5, 1000));
    }

    #[test]
    fn a_block_shrunk_across_the_threshold_keeps_its_bytes() {
        let mut block = Block::new(2 * LARGE, 8);
        block.fill(6);
        block.resize(LARGE - 1);
        assert!(block.holds(6, LARGE - 1));
        block.resize(10);
        assert!(block.holds(6, 10));
    }

    #[test]
    fn a_zeroed_block_is_zero_large_or_small() {
        for size in [24, LARGE - 8, LARGE, 5 * LARGE + 1] {
            let mut block = Block::zeroed(size);
            assert!(block.bytes().iter().all(|b| *b == 0), "{size}");
        }
    }

    #[test]
    fn an_over_aligned_large_block_is_the_system_allocators_and_aligned() {
        for align in [2 * PAGE, 64 * 1024] {
            let mut block = Block::new(LARGE * 2, align);
            block.fill(7);
            block.resize(LARGE * 3);
            assert!(block.holds(7, LARGE * 2));
        }
    }

    #[test]
    fn a_vec_grown_past_the_threshold_and_shrunk_keeps_its_values() {
        // Through the global allocator, as the store's buffers are.
        let mut values: Vec<u32> = (0..100_000).collect();
        values.truncate(10);
        values.shrink_to_fit();
        assert_eq!(values, (0..10).collect::<Vec<_>>());
    }

    #[derive(Debug, Clone)]
    enum Op {
        Alloc {
            size: usize,
            align: usize,
            zeroed: bool,
        },
        Resize {
            which: usize,
            size: usize,
        },
        Free {
            which: usize,
        },
    }

    /// Sizes on both sides of the threshold, and at it.
    fn size() -> impl Strategy<Value = usize> {
        prop_oneof![1usize..4096, (LARGE - 64)..(LARGE + 64), LARGE..(6 * LARGE),]
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (
                size(),
                prop::sample::select(vec![1usize, 8, 64, PAGE, 2 * PAGE]),
                any::<bool>()
            )
                .prop_map(|(size, align, zeroed)| Op::Alloc {
                    size,
                    align,
                    zeroed
                }),
            (any::<usize>(), size()).prop_map(|(which, size)| Op::Resize { which, size }),
            any::<usize>().prop_map(|which| Op::Free { which }),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]

        /// Random allocations, reallocations and frees: every live block
        /// keeps the bytes last written to it, up to its size.
        #[test]
        fn blocks_keep_their_bytes_through_any_sequence(ops in prop::collection::vec(op(), 1..40)) {
            let mut live: Vec<(Block, u8)> = Vec::new();
            for (n, op) in ops.into_iter().enumerate() {
                let seed = n as u8;
                match op {
                    Op::Alloc { size, align, zeroed } => {
                        let mut block = if zeroed && align == 8 {
                            let mut b = Block::zeroed(size);
                            prop_assert!(b.bytes().iter().all(|b| *b == 0));
                            b
                        } else {
                            Block::new(size, align)
                        };
                        block.fill(seed);
                        live.push((block, seed));
                    }
                    Op::Resize { which, size } if !live.is_empty() => {
                        let at = which % live.len();
                        let (block, old) = &mut live[at];
                        let kept = block.layout.size().min(size);
                        block.resize(size);
                        prop_assert!(block.holds(*old, kept));
                        block.fill(seed);
                        *old = seed;
                    }
                    Op::Free { which } if !live.is_empty() => {
                        let at = which % live.len();
                        let (mut block, seed) = live.swap_remove(at);
                        prop_assert!(block.holds(seed, block.layout.size()));
                    }
                    _ => {}
                }
            }
            for (block, seed) in &mut live {
                let len = block.layout.size();
                prop_assert!(block.holds(*seed, len));
            }
        }
    }
}
