package main

import (
	"context"
	"fmt"

	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/util/validation/field"
	"k8s.io/apiserver/pkg/registry/generic"
	genericregistry "k8s.io/apiserver/pkg/registry/generic/registry"
	"k8s.io/apiserver/pkg/registry/rest"
	"k8s.io/apiserver/pkg/storage"
	"k8s.io/apiserver/pkg/storage/names"
)

// kind describes one served resource: how to make its objects, whether it is
// namespaced, and which fields a field selector may use.
type kind struct {
	plural, singular string
	group            string
	namespaced       bool
	newObj           func() runtime.Object
	newList          func() runtime.Object
	fields           func(obj runtime.Object) fields.Set
	validate         func(obj runtime.Object) field.ErrorList
}

// === the common strategy ===

// strategy is the create/update/delete policy shared by all kinds here: the
// generic checks only (object meta, names), plus per-kind validation.
type strategy struct {
	runtime.ObjectTyper
	names.NameGenerator
	k *kind
}

func (s strategy) NamespaceScoped() bool                                    { return s.k.namespaced }
func (s strategy) PrepareForCreate(ctx context.Context, obj runtime.Object) {}
func (s strategy) PrepareForUpdate(ctx context.Context, obj, old runtime.Object) {
}
func (s strategy) Validate(ctx context.Context, obj runtime.Object) field.ErrorList {
	if s.k.validate == nil {
		return nil
	}
	return s.k.validate(obj)
}
func (s strategy) WarningsOnCreate(ctx context.Context, obj runtime.Object) []string { return nil }
func (s strategy) Canonicalize(obj runtime.Object)                                   {}
func (s strategy) AllowCreateOnUpdate() bool                                         { return false }
func (s strategy) ValidateUpdate(ctx context.Context, obj, old runtime.Object) field.ErrorList {
	return s.Validate(ctx, obj)
}
func (s strategy) WarningsOnUpdate(ctx context.Context, obj, old runtime.Object) []string {
	return nil
}
func (s strategy) AllowUnconditionalUpdate() bool { return true }

// newStore builds the etcd3-backed store (with the watch cache when enabled)
// for a kind, using strategy st for every verb.
func newStore(k *kind, st interface {
	rest.RESTCreateStrategy
	rest.RESTUpdateStrategy
	rest.RESTDeleteStrategy
}, opts generic.RESTOptionsGetter) (*genericregistry.Store, error) {
	store := &genericregistry.Store{
		NewFunc:                   k.newObj,
		NewListFunc:               k.newList,
		DefaultQualifiedResource:  schema.GroupResource{Group: k.group, Resource: k.plural},
		SingularQualifiedResource: schema.GroupResource{Group: k.group, Resource: k.singular},
		PredicateFunc: func(label labels.Selector, field fields.Selector) storage.SelectionPredicate {
			return storage.SelectionPredicate{Label: label, Field: field, GetAttrs: k.attrs}
		},
		CreateStrategy: st,
		UpdateStrategy: st,
		DeleteStrategy: st,
		TableConvertor: rest.NewDefaultTableConvertor(schema.GroupResource{Group: k.group, Resource: k.plural}),
	}
	if err := store.CompleteWithOptions(&generic.StoreOptions{RESTOptions: opts, AttrFunc: k.attrs}); err != nil {
		return nil, fmt.Errorf("%s store: %w", k.plural, err)
	}
	return store, nil
}

func (k *kind) attrs(obj runtime.Object) (labels.Set, fields.Set, error) {
	meta, err := metaOf(obj)
	if err != nil {
		return nil, nil, err
	}
	set := generic.ObjectMetaFieldsSet(meta, k.namespaced)
	if k.fields != nil {
		for key, v := range k.fields(obj) {
			set[key] = v
		}
	}
	return labels.Set(meta.Labels), set, nil
}

func metaOf(obj runtime.Object) (*metav1.ObjectMeta, error) {
	switch o := obj.(type) {
	case *corev1.Pod:
		return &o.ObjectMeta, nil
	case *corev1.Service:
		return &o.ObjectMeta, nil
	case *corev1.Namespace:
		return &o.ObjectMeta, nil
	case *discoveryv1.EndpointSlice:
		return &o.ObjectMeta, nil
	}
	return nil, fmt.Errorf("unexpected object type %T", obj)
}

// === kinds ===

var namespaceKind = &kind{
	plural: "namespaces", singular: "namespace",
	newObj:  func() runtime.Object { return &corev1.Namespace{} },
	newList: func() runtime.Object { return &corev1.NamespaceList{} },
}

var serviceKind = &kind{
	plural: "services", singular: "service", namespaced: true,
	newObj:  func() runtime.Object { return &corev1.Service{} },
	newList: func() runtime.Object { return &corev1.ServiceList{} },
	validate: func(obj runtime.Object) field.ErrorList {
		svc := obj.(*corev1.Service)
		var errs field.ErrorList
		for i, p := range svc.Spec.Ports {
			if p.Port < 1 || p.Port > 65535 {
				errs = append(errs, field.Invalid(field.NewPath("spec", "ports").Index(i).Child("port"), p.Port, "must be 1-65535"))
			}
		}
		return errs
	},
}

var endpointSliceKind = &kind{
	plural: "endpointslices", singular: "endpointslice", group: discoveryv1.GroupName, namespaced: true,
	newObj:  func() runtime.Object { return &discoveryv1.EndpointSlice{} },
	newList: func() runtime.Object { return &discoveryv1.EndpointSliceList{} },
	fields: func(obj runtime.Object) fields.Set {
		return fields.Set{"addressType": string(obj.(*discoveryv1.EndpointSlice).AddressType)}
	},
	validate: func(obj runtime.Object) field.ErrorList {
		s := obj.(*discoveryv1.EndpointSlice)
		var errs field.ErrorList
		switch s.AddressType {
		case discoveryv1.AddressTypeIPv4, discoveryv1.AddressTypeIPv6, discoveryv1.AddressTypeFQDN:
		default:
			errs = append(errs, field.NotSupported(field.NewPath("addressType"), s.AddressType, []string{"IPv4", "IPv6", "FQDN"}))
		}
		for i, ep := range s.Endpoints {
			if len(ep.Addresses) == 0 {
				errs = append(errs, field.Required(field.NewPath("endpoints").Index(i).Child("addresses"), ""))
			}
		}
		return errs
	},
}

// storageFor builds the REST storage of the plain kinds (everything but pods).
func storageFor(k *kind, opts generic.RESTOptionsGetter) (*genericregistry.Store, error) {
	return newStore(k, strategy{scheme, names.SimpleNameGenerator, k}, opts)
}
