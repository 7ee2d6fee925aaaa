//! Exports only the module's own hooks: a dependency's `#[no_mangle]`
//! symbols (none today; the Wasm SDK's, were it ever linked in) stay local.
//! The module is linked with immediate binding, so every symbol it keeps
//! must resolve when Envoy loads it: an unexpected import is a load error,
//! never a crash at a later call.
fn main() {
    println!("cargo:rustc-cdylib-link-arg=-Wl,--exclude-libs=ALL");
}
