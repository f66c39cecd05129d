"""Job shapes from API-server objects (replicator/coordinator/kube/kube_shape.py): pure, over plain dicts and lightkube
models, with the bad-data cases named by pod and field."""

import copy

from lightkube import codecs
from lightkube.generic_resource import create_namespaced_resource

from replicator.coordinator.kube.kube_shape import (
    FailureDomains,
    JobShape,
    ShapeSettings,
    read_pod,
)
from replicator.wire.messages import JobRef
from tests.helpers.kube_objects import (
    DRIVER,
    EXAMPLE_NODES,
    NS,
    example_pods,
    jobset,
    node,
    pod,
    pod_at,
    replicated_job,
    shapes_of,
)


def places(shape: JobShape) -> list[tuple]:
    return [(p.slice, p.worker, p.name, p.dns_name, p.ip, p.node) for p in shape.pods]


def problems(shapes) -> list[tuple[str, str, str]]:
    return [(p.kind, p.name, p.field) for p in shapes.problems]


def test_example_jobset_shape_has_four_nodes_two_slices_and_jobset_dns_names():
    shapes = shapes_of(example_pods(), EXAMPLE_NODES, [jobset("llama-train", replicated_job("slice", 2, 2))])
    assert shapes.problems == ()
    key = JobRef(NS, "llama-train-slice")
    assert list(shapes.jobs) == [key]
    shape = shapes.jobs[key]
    assert (shape.jobset, shape.jobset_uid, shape.replicated_jobs) == ("llama-train", "uid-1", ("slice",))
    assert (shape.nodes, shape.slices, shape.nodes_per_slice) == (4, 2, 2)
    assert places(shape) == [
        (
            s,
            w,
            f"llama-train-slice-{s}-{w}-abcde",
            f"llama-train-slice-{s}-{w}.llama-train",
            f"10.1.{s}.{w}",
            f"n{s}{w}",
        )
        for s in range(2)
        for w in range(2)
    ]
    assert pod_at(shape, 1, 0).domains == FailureDomains(zone="zone-1", nodepool="pool-1", block="block-0")
    assert pod_at(shape, 2, 0) is None


def test_lightkube_models_give_the_same_shape_as_dicts():
    create_namespaced_resource("jobset.x-k8s.io", "v1alpha2", "JobSet", "jobsets")  # codecs.from_dict finds it
    objects = (example_pods(), EXAMPLE_NODES, [jobset("llama-train", replicated_job("slice", 2, 2))])
    models = [[codecs.from_dict(copy.deepcopy(o)) for o in group] for group in objects]
    assert type(models[0][0]).__name__ == "Pod" and type(models[2][0]).__name__ == "JobSet"
    from_models = shapes_of(*models)
    assert from_models == shapes_of(*objects)
    assert from_models.jobs[JobRef(NS, "llama-train-slice")].nodes == 4


def test_driver_replicated_job_without_the_volume_counts_for_nothing():
    spec = jobset("train", replicated_job("driver", 1, 1, mounts=False), replicated_job("workers", 3, 2))
    pods = [pod("train", "driver", 0, 0, mounts=False)] + [
        pod("train", "workers", s, w) for s in range(3) for w in range(2)
    ]
    shapes = shapes_of(pods, [], [spec])
    assert shapes.problems == ()
    assert list(shapes.jobs) == [JobRef(NS, "train-workers")]
    shape = shapes.jobs[JobRef(NS, "train-workers")]
    assert (shape.nodes, shape.slices, shape.nodes_per_slice, shape.replicated_jobs) == (6, 3, 2, ("workers",))
    assert [(p.slice, p.worker) for p in shape.pods] == [(s, w) for s in range(3) for w in range(2)]
    assert {p.domains for p in shape.pods} == {None}  # unscheduled


def test_replicated_jobs_sharing_a_job_number_slices_in_spec_order():
    spec = jobset(
        "train",
        replicated_job("a", 2, 2, job="big"),
        replicated_job("driver", 1, 1, mounts=False),
        replicated_job("b", 1, 2, job="big"),
    )
    pods = [pod("train", "a", s, w, attributes={"job": "big"}) for s in range(2) for w in range(2)]
    pods += [pod("train", "b", 0, w, attributes={"job": "big"}) for w in range(2)]
    shapes = shapes_of(pods, [], [spec])
    assert shapes.problems == ()
    shape = shapes.jobs[JobRef(NS, "big")]
    assert (shape.nodes, shape.slices, shape.replicated_jobs) == (6, 3, ("a", "b"))
    assert [(p.slice, p.worker, p.name) for p in shape.pods][-2:] == [
        (2, 0, "train-b-0-0-abcde"),
        (2, 1, "train-b-0-1-abcde"),
    ]


def test_replicated_jobs_without_a_job_attribute_are_separate_jobs():
    spec = jobset("train", replicated_job("a", 1, 2), replicated_job("b", 2, 1))
    shapes = shapes_of([pod("train", "b", 1, 0)], [], [spec])
    assert {k: (s.nodes, s.slices) for k, s in shapes.jobs.items()} == {
        JobRef(NS, "train-a"): (2, 1),
        JobRef(NS, "train-b"): (2, 2),
    }
    assert [(p.slice, p.worker) for p in shapes.jobs[JobRef(NS, "train-b")].pods] == [(1, 0)]


def test_configurable_block_label_reads_the_rack():
    nodes = [node("n00", "z", "p", "rack-7", block_label="example.com/rack")]
    shapes = shapes_of(
        [pod("t", "w", 0, 0, node="n00")],
        nodes,
        [jobset("t", replicated_job("w", 1, 1))],
        ShapeSettings(block_label="example.com/rack"),
    )
    assert shapes.jobs[JobRef(NS, "t-w")].pods[0].domains == FailureDomains("z", "p", "rack-7")


def test_pods_not_mounting_our_driver_finished_or_deleting_are_not_in_the_shape():
    other = pod("t", "w", 0, 0)
    other["spec"]["volumes"][0]["csi"]["driver"] = "other.csi.example"
    assert read_pod(other) is None
    pods = [
        other,
        pod("t", "w", 0, 1, status__phase="Failed"),
        pod("t", "w", 1, 0, metadata__deletionTimestamp="2026-01-01T00:00:00Z"),
        pod("t", "w", 1, 1),
    ]
    shapes = shapes_of(pods, [], [jobset("t", replicated_job("w", 2, 2))])
    assert shapes.problems == ()
    assert [(p.slice, p.worker) for p in shapes.jobs[JobRef(NS, "t-w")].pods] == [(1, 1)]


def test_pod_whose_jobset_is_gone_is_refused_naming_pod_and_annotation():
    shapes = shapes_of([pod("gone", "w", 0, 0)], [], [])
    assert shapes.jobs == {}
    (problem,) = shapes.problems
    assert str(problem) == (
        "Pod default/gone-w-0-0-abcde: annotation jobset.sigs.k8s.io/jobset-name: "
        "JobSet 'gone' is gone from namespace 'default'"
    )


def test_pod_of_an_earlier_jobset_with_the_same_name_is_refused():
    shapes = shapes_of([pod("t", "w", 0, 0, uid="old")], [], [jobset("t", replicated_job("w", 1, 1), uid="new")])
    assert problems(shapes) == [("Pod", "t-w-0-0-abcde", "label jobset.sigs.k8s.io/jobset-uid")]
    assert shapes.jobs[JobRef(NS, "t-w")].pods == ()


def test_missing_or_out_of_range_annotations_are_refused_by_field():
    annotations = "metadata__annotations__"
    pods = [
        pod("t", "w", 0, 0, **{annotations + "batch.kubernetes.io/job-completion-index": None}),
        pod("t", "w", 0, 1, **{annotations + "jobset.sigs.k8s.io/job-index": "5"}),
        pod("t", "w", 1, 0, **{annotations + "jobset.sigs.k8s.io/replicatedjob-name": "nope"}),
        pod("t", "w", 1, 1, **{annotations + "jobset.sigs.k8s.io/jobset-name": None}),
        pod("t", "w", 1, 1, **{annotations + "batch.kubernetes.io/job-completion-index": " 1"}),
    ]
    shapes = shapes_of(pods, [], [jobset("t", replicated_job("w", 2, 2))])
    assert [(p.name, p.field) for p in shapes.problems] == [
        ("t-w-0-0-abcde", "annotation batch.kubernetes.io/job-completion-index"),
        ("t-w-0-1-abcde", "annotation jobset.sigs.k8s.io/job-index"),
        ("t-w-1-0-abcde", "annotation jobset.sigs.k8s.io/replicatedjob-name"),
        ("t-w-1-1-abcde", "annotation jobset.sigs.k8s.io/jobset-name"),
        ("t-w-1-1-abcde", "annotation batch.kubernetes.io/job-completion-index"),
    ]
    assert "'5' is not an index below replicas 2" in shapes.problems[1].reason
    assert shapes.jobs[JobRef(NS, "t-w")].pods == ()


def test_volume_attributes_contradicting_the_api_server_are_refused():
    spec = jobset("t", replicated_job("w", 2, 2))
    cases = {"nodes": "3", "slices": "1", "slice": "1", "worker": "1", "jobset": "t-w"}
    for attribute, value in cases.items():
        shapes = shapes_of([pod("t", "w", 0, 0, attributes={attribute: value})], [], [spec])
        (problem,) = shapes.problems
        assert (problem.name, problem.field) == ("t-w-0-0-abcde", f"volume attribute {attribute}")
        assert problem.reason.startswith(f"{value!r} contradicts the API server's")
    agreeing = {"nodes": "4", "slices": "2", "slice": "0", "worker": "0", "jobset": "t"}
    shapes = shapes_of([pod("t", "w", 0, 0, attributes=agreeing)], [], [spec])
    assert shapes.problems == () and len(shapes.jobs[JobRef(NS, "t-w")].pods) == 1


def test_inconsistent_jobset_specs_give_no_shape_and_name_the_field():
    cases = [
        (jobset("t", replicated_job("a", 1, 2, job="j"), replicated_job("b", 1, 3, job="j")), "spec.replicatedJobs"),
        (jobset("t", {**replicated_job("w", 1, 2), "replicas": "two"}), "spec.replicatedJobs[0].replicas"),
    ]
    not_indexed = replicated_job("w", 1, 2)
    del not_indexed["template"]["spec"]["completionMode"]
    cases.append((jobset("t", not_indexed), "spec.replicatedJobs[0].template.spec.completionMode"))
    more_completions = replicated_job("w", 1, 2)
    more_completions["template"]["spec"]["completions"] = 4
    cases.append((jobset("t", more_completions), "spec.replicatedJobs[0].template.spec.completions"))
    cases.append((jobset("t", replicated_job("w" * 70, 1, 1)), "spec.replicatedJobs"))
    for spec, field in cases:
        shapes = shapes_of([], [], [spec])
        assert shapes.jobs == {}
        assert [(p.kind, p.name, p.field) for p in shapes.problems] == [("JobSet", "t", field)]


def test_two_jobsets_naming_one_job_keep_the_first_and_name_the_second():
    shapes = shapes_of(
        [], [], [jobset("a", replicated_job("w", 1, 1, job="j")), jobset("b", replicated_job("w", 1, 1, job="j"))]
    )
    assert shapes.jobs[JobRef(NS, "j")].jobset == "a"
    assert problems(shapes) == [("JobSet", "b", "volume attribute job")]


def test_a_pod_of_the_second_jobset_naming_the_first_ones_job_is_refused_not_a_crash():
    # A pod author choosing the volume attribute ``job`` could name another JobSet's job: before, the pod was placed
    # with the first JobSet's group and its replicatedJob's lookup raised KeyError out of the API server's view.
    shapes = shapes_of(
        [pod("b", "y", 0, 0, attributes={"job": "j"}, uid="uid-2")],
        [],
        [jobset("a", replicated_job("x", 1, 1, job="j")), jobset("b", replicated_job("y", 1, 1, job="j"), uid="uid-2")],
    )
    assert shapes.jobs[JobRef(NS, "j")].jobset == "a" and shapes.jobs[JobRef(NS, "j")].pods == ()
    assert problems(shapes) == [("JobSet", "b", "volume attribute job"), ("Pod", "b-y-0-0-abcde", "JobSet b")]


def test_two_live_pods_at_one_place_keep_the_newer_restart_attempt_or_neither():
    spec = jobset("t", replicated_job("w", 1, 1))
    old, new = pod("t", "w", 0, 0, attempt=0), pod("t", "w", 0, 0, attempt=1, metadata__name="t-w-0-0-newer")
    assert [p.name for p in shapes_of([old, new], [], [spec]).jobs[JobRef(NS, "t-w")].pods] == ["t-w-0-0-newer"]
    twin = pod("t", "w", 0, 0, metadata__name="t-w-0-0-twin")
    shapes = shapes_of([old, twin], [], [spec])
    assert shapes.jobs[JobRef(NS, "t-w")].pods == ()
    assert problems(shapes) == [
        ("Pod", "t-w-0-0-abcde", "annotations jobset.sigs.k8s.io/job-index, batch.kubernetes.io/job-completion-index")
    ]


def test_garbage_objects_never_raise():
    garbage = [{}, {"metadata": None}, {"spec": {"volumes": [{"csi": {"driver": DRIVER}}]}}, {"spec": "x"}]
    shapes = shapes_of(garbage, garbage, garbage + [{"spec": {"replicatedJobs": [{"template": None}, None]}}])
    assert shapes.jobs == {}
    assert [p.field for p in shapes.problems] == ["annotation jobset.sigs.k8s.io/jobset-name"]
