//! Exports only the module's own hooks. The filter crate's proxy-wasm
//! dependency exports its `proxy_on_*` entry points, which call hostcalls
//! no native Envoy has; left in, the module would not load (it is linked
//! with immediate binding: every symbol it keeps must resolve at dlopen).
//! Symbols of the dependencies' archives stay local; the hooks, defined in
//! this crate, are exported.
fn main() {
    println!("cargo:rustc-cdylib-link-arg=-Wl,--exclude-libs=ALL");
}
