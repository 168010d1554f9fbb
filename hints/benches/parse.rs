//! Parse throughput of the two forms on the same generated stream.

use std::io::Cursor;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use hints::gen::{GenParams, Workload, WorkloadKind};
use hints::{Format, HintReader, HintWriter};

fn encode(w: &Workload, format: Format) -> Vec<u8> {
    let mut writer = HintWriter::new(Vec::new(), format, &w.header(), "bench").unwrap();
    for r in w.records() {
        writer.write(&r).unwrap();
    }
    writer.finish().unwrap()
}

fn parse(c: &mut Criterion) {
    let params = GenParams {
        scale: 0.5,
        ..GenParams::default()
    };
    let w = Workload::generate(WorkloadKind::Random, &params).unwrap();
    let records = w.accesses.len() as u64;
    let mut group = c.benchmark_group("parse");
    group.throughput(Throughput::Elements(records));
    for format in [Format::Text, Format::Binary] {
        let bytes = encode(&w, format);
        group.bench_function(format.name(), |b| {
            b.iter(|| {
                let reader = HintReader::from_reader(Cursor::new(bytes.clone()), "bench").unwrap();
                let mut n = 0u64;
                for r in reader {
                    r.unwrap();
                    n += 1;
                }
                assert_eq!(n, records);
            })
        });
    }
    group.finish();
}

criterion_group!(benches, parse);
criterion_main!(benches);
