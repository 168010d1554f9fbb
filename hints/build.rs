fn main() {
    println!("cargo:rerun-if-changed=proto/hints.proto");
    prost_build::compile_protos(&["proto/hints.proto"], &["proto/"])
        .expect("protoc (Debian package protobuf-compiler) must be installed: run `make deps`");
}
