//! `sqlx::migrate!` embeds `../migrations` at compile time but does not notice new files itself.

fn main() {
    println!("cargo:rerun-if-changed=../migrations");
}
