package main

import (
	"context"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/util/validation/field"
	"k8s.io/apiserver/pkg/registry/generic"
	genericregistry "k8s.io/apiserver/pkg/registry/generic/registry"
	"k8s.io/apiserver/pkg/registry/rest"
	"k8s.io/apiserver/pkg/storage/names"
)

var podKind = &kind{
	plural: "pods", singular: "pod", namespaced: true,
	newObj:  func() runtime.Object { return &corev1.Pod{} },
	newList: func() runtime.Object { return &corev1.PodList{} },
	fields: func(obj runtime.Object) fields.Set {
		pod := obj.(*corev1.Pod)
		return fields.Set{
			"spec.nodeName": pod.Spec.NodeName,
			"status.phase":  string(pod.Status.Phase),
			"status.podIP":  pod.Status.PodIP,
		}
	},
	validate: func(obj runtime.Object) field.ErrorList {
		pod := obj.(*corev1.Pod)
		var errs field.ErrorList
		if len(pod.Spec.Containers) == 0 {
			errs = append(errs, field.Required(field.NewPath("spec", "containers"), "a pod needs a container"))
		}
		for i, c := range pod.Spec.Containers {
			if c.Name == "" {
				errs = append(errs, field.Required(field.NewPath("spec", "containers").Index(i).Child("name"), ""))
			}
		}
		return errs
	},
}

// defaultGracePeriod is the real API's default terminationGracePeriodSeconds.
const defaultGracePeriod int64 = 30

// podStrategy is the spec side of pods: a create starts Pending with an empty
// status, and an update of the pod never changes its status (that is what
// pods/status is for), as in the real registry.
type podStrategy struct{ strategy }

func (podStrategy) PrepareForCreate(ctx context.Context, obj runtime.Object) {
	pod := obj.(*corev1.Pod)
	pod.Status = corev1.PodStatus{Phase: corev1.PodPending}
	if pod.Spec.TerminationGracePeriodSeconds == nil {
		period := defaultGracePeriod
		pod.Spec.TerminationGracePeriodSeconds = &period
	}
}

func (podStrategy) PrepareForUpdate(ctx context.Context, obj, old runtime.Object) {
	obj.(*corev1.Pod).Status = old.(*corev1.Pod).Status
}

// CheckGracefulDelete follows the real pod strategy: the grace period comes
// from the request or else the pod spec, and it is zero (delete at once) for a
// pod no node runs (no kubelet would ever finish it) or one that has already
// finished. A bound pod deleted with a grace period keeps its
// deletionTimestamp: no kubelet here ever removes it.
func (podStrategy) CheckGracefulDelete(ctx context.Context, obj runtime.Object, options *metav1.DeleteOptions) bool {
	if options == nil {
		return false
	}
	pod := obj.(*corev1.Pod)
	period := int64(0)
	if options.GracePeriodSeconds != nil {
		period = *options.GracePeriodSeconds
	} else if pod.Spec.TerminationGracePeriodSeconds != nil {
		period = *pod.Spec.TerminationGracePeriodSeconds
	}
	if pod.Spec.NodeName == "" {
		period = 0
	}
	if pod.Status.Phase == corev1.PodFailed || pod.Status.Phase == corev1.PodSucceeded {
		period = 0
	}
	options.GracePeriodSeconds = &period
	return true
}

// podStatusStrategy is pods/status: only the status changes, as a kubelet
// writes it.
type podStatusStrategy struct{ podStrategy }

func (podStatusStrategy) PrepareForUpdate(ctx context.Context, obj, old runtime.Object) {
	newPod, oldPod := obj.(*corev1.Pod), old.(*corev1.Pod)
	newPod.Spec = oldPod.Spec
	newPod.Labels = oldPod.Labels
	newPod.Annotations = oldPod.Annotations
	newPod.OwnerReferences = oldPod.OwnerReferences
}

func (podStatusStrategy) ValidateUpdate(ctx context.Context, obj, old runtime.Object) field.ErrorList {
	pod := obj.(*corev1.Pod)
	var errs field.ErrorList
	if len(pod.Status.PodIPs) > 0 && pod.Status.PodIPs[0].IP != pod.Status.PodIP {
		errs = append(errs, field.Invalid(field.NewPath("status", "podIPs").Index(0).Child("ip"),
			pod.Status.PodIPs[0].IP, "must match status.podIP"))
	}
	return errs
}

// statusREST serves pods/status from a copy of the pod store whose update
// strategy is podStatusStrategy.
type statusREST struct{ store *genericregistry.Store }

func (r *statusREST) New() runtime.Object { return &corev1.Pod{} }
func (r *statusREST) Destroy()            {}

func (r *statusREST) Get(ctx context.Context, name string, options *metav1.GetOptions) (runtime.Object, error) {
	return r.store.Get(ctx, name, options)
}

func (r *statusREST) Update(ctx context.Context, name string, objInfo rest.UpdatedObjectInfo, createValidation rest.ValidateObjectFunc, updateValidation rest.ValidateObjectUpdateFunc, forceAllowCreate bool, options *metav1.UpdateOptions) (runtime.Object, bool, error) {
	// A status write never creates a pod.
	return r.store.Update(ctx, name, objInfo, createValidation, updateValidation, false, options)
}

func (r *statusREST) ConvertToTable(ctx context.Context, object runtime.Object, tableOptions runtime.Object) (*metav1.Table, error) {
	return r.store.ConvertToTable(ctx, object, tableOptions)
}

// podStorage returns the stores for pods and pods/status.
func podStorage(opts generic.RESTOptionsGetter) (map[string]rest.Storage, error) {
	base := strategy{scheme, names.SimpleNameGenerator, podKind}
	store, err := newStore(podKind, podStrategy{base}, opts)
	if err != nil {
		return nil, err
	}
	status := *store
	status.UpdateStrategy = podStatusStrategy{podStrategy{base}}
	return map[string]rest.Storage{
		"pods":        store,
		"pods/status": &statusREST{store: &status},
	}, nil
}
