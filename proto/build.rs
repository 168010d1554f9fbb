fn main() {
    println!("cargo:rerun-if-changed=proto/netpager.proto");
    prost_build::compile_protos(&["proto/netpager.proto"], &["proto/"])
        .expect("protoc (Debian package protobuf-compiler) must be installed: run `make deps`");
}
