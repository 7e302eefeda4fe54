//! lakeml's own CPU passes, the parts they share: a function body compiled for the vector
//! units of the CPU it runs on ([`vectorized!`]), bf16 rounding, and a parallel loop on
//! libtorch's own OpenMP threads ([`parallel`]), the team that has just run the previous
//! operator and is still spinning (found at run time through libgomp's `GOMP_parallel`,
//! which Intel's OpenMP also exports); where that entry point is missing, on rayon's.

use std::ffi::{c_int, c_uint, c_void};
use std::ops::Range;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, Ordering};

/// A function over slices that the compiler vectorizes for the CPU it runs on: the body
/// (`#[inline(always)]`) is compiled three times, for AVX-512, for AVX2 + FMA and for the
/// baseline, and the fastest the CPU supports runs.
macro_rules! vectorized {
    ($(#[$doc:meta])* fn $name:ident($($arg:ident: $ty:ty),*) $(-> $ret:ty)? = $body:path;) => {
        $(#[$doc])*
        fn $name($($arg: $ty),*) $(-> $ret)? {
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx512f")]
                unsafe fn avx512($($arg: $ty),*) $(-> $ret)? {
                    $body($($arg),*)
                }
                #[target_feature(enable = "avx2,fma")]
                unsafe fn avx2($($arg: $ty),*) $(-> $ret)? {
                    $body($($arg),*)
                }
                if is_x86_feature_detected!("avx512f") {
                    // SAFETY: the CPU supports AVX-512F (checked just above).
                    return unsafe { avx512($($arg),*) };
                }
                if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
                    // SAFETY: the CPU supports AVX2 and FMA (checked just above).
                    return unsafe { avx2($($arg),*) };
                }
            }
            $body($($arg),*)
        }
    };
}
pub(crate) use vectorized;

/// `x` rounded to the nearest bf16 (ties to even), as its bits; NaN stays NaN.
#[inline(always)]
pub(crate) fn bf16_bits(x: f32) -> u16 {
    let b = x.to_bits();
    let rounded = (b.wrapping_add(0x7fff + ((b >> 16) & 1)) >> 16) as u16;
    if x.is_nan() { 0x7fc0 } else { rounded }
}

/// A bf16 value (its bits) as fp32, exactly.
#[inline(always)]
pub(crate) fn bf16_value(bits: u16) -> f32 {
    f32::from_bits(u32::from(bits) << 16)
}

/// `x` rounded to the nearest integer (ties to even), for `|x| < 2^22`: adding 1.5 × 2^23
/// leaves that integer in the low bits of the sum's mantissa. Unlike `as`, which must
/// saturate and map NaN to 0, this is plain arithmetic that vectorizes.
#[inline(always)]
pub(crate) fn round_to_int(x: f32) -> i32 {
    const MAGIC: f32 = 12_582_912.0;
    (x + MAGIC).to_bits().wrapping_sub(MAGIC.to_bits()) as i32
}

/// `e^-x` for `x ≥ 0` (Cephes' `expf` polynomial, relative error about 1e-7), 0 from
/// `x = 87` on; branch-free so that it vectorizes.
#[inline(always)]
pub(crate) fn exp_neg(x: f32) -> f32 {
    let x = -x;
    let underflow = x < -87.0;
    let x = if underflow { -87.0 } else { x };
    let k = round_to_int(x * std::f32::consts::LOG2_E);
    let n = k as f32;
    let r = x - n * LN2_HI - n * LN2_LO;
    let p = EXP_C[1..].iter().fold(EXP_C[0], |p, &c| p * r + c) * r * r + r + 1.0;
    let two_n = f32::from_bits(((k + 127) as u32) << 23);
    if underflow { 0.0 } else { p * two_n }
}

/// ln 2 in two parts, the first exact in few bits, so that `x - n ln 2` loses nothing.
const LN2_HI: f32 = 0.693_359_4;
const LN2_LO: f32 = -2.121_944_4e-4;

/// Cephes' `expf` polynomial, highest degree first: `e^r ≈ 1 + r + r² P(r)`.
const EXP_C: [f32; 6] = [
    1.987_569_1e-4,
    1.398_199_9e-3,
    8.333_452e-3,
    4.166_579_6e-2,
    1.666_666_5e-1,
    0.5,
];

/// The error function, as PyTorch's vectorized CPU kernels compute it (Abramowitz and
/// Stegun 7.1.26, absolute error below 1.5e-7), branch-free so that it vectorizes.
#[inline(always)]
pub(crate) fn erf(x: f32) -> f32 {
    let a = x.abs();
    let t = 1.0 / (1.0 + ERF_P * a);
    let [a0, a1, a2, a3, a4] = ERF_A;
    let poly = ((((a4 * t + a3) * t + a2) * t + a1) * t + a0) * t;
    (1.0 - poly * exp_neg(a * a)).copysign(x)
}

/// [`erf`]'s constants: `erf(a) ≈ 1 - t P(t) e^-a²` with `t = 1 / (1 + ERF_P a)` and
/// `P`'s coefficients `ERF_A`, lowest degree first.
const ERF_P: f32 = 0.327_591_1;
const ERF_A: [f32; 5] = [
    0.254_829_6,
    -0.284_496_74,
    1.421_413_8,
    -1.453_152,
    1.061_405_4,
];

/// An element of a float tensor that lakeml's own passes read and write: fp32, or bf16 as
/// its bits; arithmetic is in fp32 either way.
pub(crate) trait Element: Copy {
    /// bf16 (16-bit) rather than fp32.
    const BF16: bool;
    fn value(self) -> f32;
    fn from_value(x: f32) -> Self;
}

impl Element for f32 {
    const BF16: bool = false;
    #[inline(always)]
    fn value(self) -> f32 {
        self
    }
    #[inline(always)]
    fn from_value(x: f32) -> Self {
        x
    }
}

impl Element for u16 {
    const BF16: bool = true;
    #[inline(always)]
    fn value(self) -> f32 {
        bf16_value(self)
    }
    #[inline(always)]
    fn from_value(x: f32) -> Self {
        bf16_bits(x)
    }
}

/// Whether this CPU has the AVX-512 subsets [`avx512`] is written for (F, BW and VL).
pub(crate) fn has_avx512() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        is_x86_feature_detected!("avx512f")
            && is_x86_feature_detected!("avx512bw")
            && is_x86_feature_detected!("avx512vl")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// AVX-512 building blocks of lakeml's own passes: 16 lanes of fp32 read from and written
/// to fp32 or bf16 memory, and exact GELU on them. Callers check [`has_avx512`] first.
#[cfg(target_arch = "x86_64")]
pub(crate) mod avx512 {
    use std::arch::x86_64::{
        __m512, __mmask16, _CMP_UNORD_Q, _MM_FROUND_NO_EXC, _MM_FROUND_TO_NEAREST_INT,
        _mm256_mask_storeu_epi16, _mm256_maskz_loadu_epi16, _mm512_abs_ps, _mm512_add_epi32,
        _mm512_add_ps, _mm512_and_si512, _mm512_castps_si512, _mm512_castsi512_ps,
        _mm512_cmp_ps_mask, _mm512_cvtepi32_epi16, _mm512_cvtepu16_epi32, _mm512_fmadd_ps,
        _mm512_fnmadd_ps, _mm512_mask_mov_epi32, _mm512_mask_storeu_ps, _mm512_maskz_loadu_ps,
        _mm512_min_ps, _mm512_mul_ps, _mm512_or_si512, _mm512_rcp14_ps, _mm512_roundscale_ps,
        _mm512_scalef_ps, _mm512_set1_epi32, _mm512_set1_ps, _mm512_slli_epi32, _mm512_srli_epi32,
    };

    use super::Element;

    /// Lanes of a vector.
    pub(crate) const LANES: usize = 16;

    /// The first `count` of [`LANES`] lanes.
    #[inline(always)]
    fn first(count: usize) -> __mmask16 {
        if count >= LANES {
            u16::MAX
        } else {
            (1u16 << count) - 1
        }
    }

    /// The first `count` (≤ [`LANES`]) elements at `src` as fp32 lanes, zeros past them.
    ///
    /// # Safety
    /// `count` elements at `src` must be readable; nothing past them is read.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    pub(crate) unsafe fn read<E: Element>(src: *const E, count: usize) -> __m512 {
        let m = first(count);
        // SAFETY: masked loads touch only the caller's `count` elements.
        unsafe {
            if E::BF16 {
                let bits = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, src as *const i16));
                _mm512_castsi512_ps(_mm512_slli_epi32::<16>(bits))
            } else {
                _mm512_maskz_loadu_ps(m, src as *const f32)
            }
        }
    }

    /// The first `count` (≤ [`LANES`]) lanes of `x` to `dst`, as E (bf16 rounded to nearest,
    /// ties to even, NaN kept, as [`super::bf16_bits`]).
    ///
    /// # Safety
    /// `count` elements at `dst` must be writable; nothing past them is written.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    pub(crate) unsafe fn write<E: Element>(dst: *mut E, x: __m512, count: usize) {
        let m = first(count);
        // SAFETY: masked stores touch only the caller's `count` elements.
        unsafe {
            if E::BF16 {
                let bits = _mm512_castps_si512(x);
                let odd = _mm512_and_si512(_mm512_srli_epi32::<16>(bits), _mm512_set1_epi32(1));
                let half = _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff));
                let rounded = _mm512_srli_epi32::<16>(_mm512_add_epi32(bits, half));
                let nan = _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(x, x);
                let out = _mm512_mask_mov_epi32(rounded, nan, _mm512_set1_epi32(0x7fc0));
                _mm256_mask_storeu_epi16(dst as *mut i16, m, _mm512_cvtepi32_epi16(out));
            } else {
                _mm512_mask_storeu_ps(dst as *mut f32, m, x);
            }
        }
    }

    /// Exact GELU, `0.5 x (1 + erf(x / √2))`, of 16 lanes: [`super::erf`]'s formula, with
    /// `1 / (1 + p a)` from the reciprocal estimate and one Newton step (relative error
    /// ~1e-8), and `e^-a²` as [`super::exp_neg`] with the power of two applied by `scalef`
    /// (which underflows to 0 by itself).
    #[inline]
    #[target_feature(enable = "avx512f")]
    pub(crate) fn gelu(x: __m512) -> __m512 {
        let k = _mm512_set1_ps;
        let z = _mm512_mul_ps(x, k(std::f32::consts::FRAC_1_SQRT_2));
        // Past 8, erf is 1 in fp32; the bound keeps infinities out of the reciprocal (and
        // turns NaN into 8, whose GELU, x · 1, is NaN again).
        let a = _mm512_min_ps(_mm512_abs_ps(z), k(8.0));
        let d = _mm512_fmadd_ps(k(super::ERF_P), a, k(1.0));
        let r = _mm512_rcp14_ps(d);
        let t = _mm512_mul_ps(r, _mm512_fnmadd_ps(d, r, k(2.0)));
        let [a0, a1, a2, a3, a4] = super::ERF_A;
        let mut poly = k(a4);
        for c in [a3, a2, a1, a0] {
            poly = _mm512_fmadd_ps(poly, t, k(c));
        }
        poly = _mm512_mul_ps(poly, t);
        let erf = _mm512_fnmadd_ps(poly, exp_neg(_mm512_mul_ps(a, a)), k(1.0));
        // erf ≥ 0 here: z's sign bit makes it erf(z).
        let sign = _mm512_and_si512(_mm512_castps_si512(z), _mm512_set1_epi32(i32::MIN));
        let erf = _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(erf), sign));
        _mm512_mul_ps(x, _mm512_fmadd_ps(erf, k(0.5), k(0.5)))
    }

    /// `e^-y` for `y ≥ 0`: [`super::exp_neg`]'s polynomial.
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn exp_neg(y: __m512) -> __m512 {
        let k = _mm512_set1_ps;
        let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
            _mm512_mul_ps(y, k(-std::f32::consts::LOG2_E)),
        );
        // r = -y - n ln 2, in two parts.
        let r = _mm512_fnmadd_ps(n, k(super::LN2_HI), _mm512_mul_ps(y, k(-1.0)));
        let r = _mm512_fnmadd_ps(n, k(super::LN2_LO), r);
        let mut p = k(super::EXP_C[0]);
        for c in &super::EXP_C[1..] {
            p = _mm512_fmadd_ps(p, r, k(*c));
        }
        let p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, k(1.0)));
        _mm512_scalef_ps(p, n)
    }
}

/// A pointer that the threads of [`parallel`] write through, each to its own rows.
#[derive(Clone, Copy)]
pub(crate) struct Shared<T>(pub(crate) *mut T);

// SAFETY: the callers hand each thread disjoint rows of the memory behind the pointer.
unsafe impl<T> Send for Shared<T> {}
// SAFETY: as above.
unsafe impl<T> Sync for Shared<T> {}

impl<T> Shared<T> {
    /// The pointer `offset` elements further on.
    ///
    /// # Safety
    /// `offset` must stay inside the allocation.
    pub(crate) unsafe fn at(self, offset: usize) -> *mut T {
        // SAFETY: the caller keeps `offset` inside the allocation.
        unsafe { self.0.add(offset) }
    }
}

/// Runs `f` over `0..tasks`, split into one contiguous range per thread of libtorch's OpenMP
/// team (as many as `tch::set_num_threads` gave the calling thread), or of rayon's pool
/// where libtorch's OpenMP runtime cannot be found. Returns when every range is done.
pub(crate) fn parallel(tasks: usize, f: &(dyn Fn(Range<usize>) + Sync)) {
    match omp() {
        Some(omp) => omp.run(tasks, f),
        None => on_rayon(tasks, f),
    }
}

fn on_rayon(tasks: usize, f: &(dyn Fn(Range<usize>) + Sync)) {
    use rayon::prelude::*;
    let threads = rayon::current_num_threads().max(1);
    (0..threads)
        .into_par_iter()
        .for_each(|t| f(t * tasks / threads..(t + 1) * tasks / threads));
}

/// The OpenMP entry points libtorch's own operators reach through `#pragma omp parallel`.
struct Omp {
    /// `GOMP_parallel(fn, data, num_threads, flags)`: runs `fn(data)` on every thread of a
    /// team (0 threads: the calling thread's `omp_set_num_threads`), the caller included.
    parallel: unsafe extern "C" fn(extern "C" fn(*mut c_void), *mut c_void, c_uint, c_uint),
    thread_num: unsafe extern "C" fn() -> c_int,
    num_threads: unsafe extern "C" fn() -> c_int,
}

/// What one [`Omp::run`] hands each thread.
struct Job<'a> {
    omp: &'a Omp,
    tasks: usize,
    f: &'a (dyn Fn(Range<usize>) + Sync),
    panicked: AtomicBool,
}

impl Omp {
    fn run(&self, tasks: usize, f: &(dyn Fn(Range<usize>) + Sync)) {
        let job = Job {
            omp: self,
            tasks,
            f,
            panicked: AtomicBool::new(false),
        };
        // SAFETY: `each` only reads `job`, which outlives the call: GOMP_parallel returns
        // after every thread of the team has returned from `each`.
        unsafe { (self.parallel)(each, &job as *const Job as *mut c_void, 0, 0) };
        // A panic must not unwind through OpenMP's C frames; `each` catches it, and it is
        // raised again here, on the caller's thread, where tch's panics surface too.
        assert!(
            !job.panicked.load(Ordering::Relaxed),
            "a CPU pass panicked on an OpenMP thread"
        );
    }
}

extern "C" fn each(data: *mut c_void) {
    // SAFETY: `data` is the `Job` that `Omp::run` passed, alive until every thread returns.
    let job = unsafe { &*(data as *const Job) };
    // SAFETY: plain OpenMP queries, made inside the parallel region.
    let (id, team) = unsafe {
        (
            (job.omp.thread_num)().max(0) as usize,
            (job.omp.num_threads)().max(1) as usize,
        )
    };
    let range = id * job.tasks / team..(id + 1) * job.tasks / team;
    let ran = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| (job.f)(range)));
    if ran.is_err() {
        job.panicked.store(true, Ordering::Relaxed);
    }
}

/// libtorch's OpenMP runtime, looked up once among the loaded libraries.
fn omp() -> Option<&'static Omp> {
    static OMP: OnceLock<Option<Omp>> = OnceLock::new();
    OMP.get_or_init(|| {
        let find = |name: &std::ffi::CStr| {
            // SAFETY: dlsym with a NUL-terminated name; RTLD_DEFAULT searches the libraries
            // already loaded (libtorch's OpenMP runtime among them).
            let p = unsafe { libc::dlsym(libc::RTLD_DEFAULT, name.as_ptr()) };
            (!p.is_null()).then_some(p)
        };
        let parallel = find(c"GOMP_parallel")?;
        let thread_num = find(c"omp_get_thread_num")?;
        let num_threads = find(c"omp_get_num_threads")?;
        // SAFETY: these are the OpenMP runtime's exported functions, with the signatures of
        // libgomp's ABI (which Intel's and LLVM's OpenMP runtimes export as well).
        unsafe {
            Some(Omp {
                parallel: std::mem::transmute::<
                    *mut c_void,
                    unsafe extern "C" fn(extern "C" fn(*mut c_void), *mut c_void, c_uint, c_uint),
                >(parallel),
                thread_num: std::mem::transmute::<*mut c_void, unsafe extern "C" fn() -> c_int>(
                    thread_num,
                ),
                num_threads: std::mem::transmute::<*mut c_void, unsafe extern "C" fn() -> c_int>(
                    num_threads,
                ),
            })
        }
    })
    .as_ref()
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicUsize;

    use tch::{Kind, Tensor};

    use super::*;

    #[test]
    fn bf16_rounds_to_nearest_even() {
        for x in [
            1.0f32,
            -2.5,
            1.0 + 2f32.powi(-8),
            1.0 + 3.0 * 2f32.powi(-8),
            3.4e38,
            1e-40,
        ] {
            let want = Tensor::from_slice(&[x])
                .to_kind(Kind::BFloat16)
                .to_kind(Kind::Float);
            let got = bf16_value(bf16_bits(x));
            assert_eq!(got, f32::try_from(&want).expect("scalar"), "{x}");
        }
        assert!(bf16_value(bf16_bits(f32::NAN)).is_nan());
    }

    #[test]
    fn every_task_runs_exactly_once_on_either_pool() {
        assert!(omp().is_some(), "libtorch's OpenMP runtime was not found");
        for run in [
            parallel as fn(usize, &(dyn Fn(Range<usize>) + Sync)),
            on_rayon,
        ] {
            for tasks in [0, 1, 2, 3, 7, 1000] {
                let counts: Vec<AtomicUsize> = (0..tasks).map(|_| AtomicUsize::new(0)).collect();
                run(tasks, &|range| {
                    for i in range {
                        counts[i].fetch_add(1, Ordering::Relaxed);
                    }
                });
                assert!(
                    counts.iter().all(|c| c.load(Ordering::Relaxed) == 1),
                    "{tasks} tasks"
                );
            }
        }
    }
}
